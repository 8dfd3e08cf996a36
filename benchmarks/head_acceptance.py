#!/usr/bin/env python3
"""How well heads predict: mean acceptance length and acceptance per tree depth on MT-bench.

Each head drives the same fixed draft tree (so every round drafts, whatever it costs), greedy,
over MT-bench first turns; plain decoding runs beside it to check the output. Compares heads
trained on different data or with different recipes on the measure that makes speed.

    .venv/bin/python benchmarks/head_acceptance.py -m TARGET.gguf --head shipped=heads/... \
        --head distilled=work/head [--tree 6,4,2] [-N 8] [-n 64]

Prints a markdown table and writes JSON (default bench-out/head_acceptance.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import heads
from eagle_llamacpp.bench import pick_questions, plain_greedy
from eagle_llamacpp.chat import ChatRenderer
from eagle_llamacpp.engine import EagleLlama, Sampling
from eagle_llamacpp.stats import SpecStats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--target", required=True)
    p.add_argument("--head", action="append", required=True, help="LABEL=HEAD_DIR (HF layout), repeatable")
    p.add_argument("--tree", default="6,4,2", help="TOTAL,DEPTH,TOP_K of the fixed tree")
    p.add_argument("--draft-vocab", type=int, default=None, help="as convert_eagle.py (default: its default)")
    p.add_argument("-N", "--n-prompts", type=int, default=8)
    p.add_argument("-n", "--n-predict", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", default="bench-out/head_acceptance.json")
    args = p.parse_args()

    target = Path(args.target)
    tree = tuple(int(v) for v in args.tree.split(","))
    labels = dict(h.split("=", 1) for h in args.head)
    rows = {}
    prompts, want = None, []
    for label, head in labels.items():
        llm = EagleLlama(target, heads.draft_gguf(Path(head), target, args.draft_vocab), n_threads=args.threads,
                         tree=tree)
        try:
            if prompts is None:
                renderer = ChatRenderer(llm.target)
                prompts = [renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}])
                           for q in pick_questions(args.n_prompts)]
                want = [plain_greedy(llm, prompt, args.n_predict)[0] for prompt in prompts]
            stats, same = SpecStats(), 0
            for prompt, ref in zip(prompts, want):
                same += list(llm.generate(prompt, args.n_predict, Sampling(temperature=0.0), stats)) == ref
        finally:
            llm.close()
        card = Path(head) / "training.json"
        top1 = json.loads(card.read_text())["eval"].get("top1_per_step") if card.exists() else None
        rows[label] = {"head": head, **stats.as_dict(), "same_as_plain": same, "held_out_top1_per_step": top1}

    depth = max(len(r["acceptance_rate_at_depth"]) for r in rows.values())
    print(f"| head | acceptance length | " + " | ".join(f"accepted at depth {d + 1}" for d in range(depth)) +
          f" | held-out top-1 per step | same as plain (of {len(prompts)}) |")
    print("|---|---|" + "---|" * depth + "---|---|")
    for label, r in rows.items():
        rates = r["acceptance_rate_at_depth"] + [0.0] * (depth - len(r["acceptance_rate_at_depth"]))
        top1 = ", ".join(f"{v:.3f}" for v in r["held_out_top1_per_step"] or []) or "-"
        print(f"| {label} | {r['mean_acceptance_length']:.2f} | " + " | ".join(f"{v:.0%}" for v in rates) +
              f" | {top1} | {r['same_as_plain']} |")
    out = {"target": target.name, "tree": tree, "n_prompts": len(prompts), "n_predict": args.n_predict, "heads": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
