#!/usr/bin/env python3
"""Which draft vocabulary size and weight type to convert a head with: acceptance against draft cost.

The shipped head is converted once per size and type (cached); each draft drives a fixed tree, so
that it drafts every round and its cost shows, over MT-bench first turns, greedy, interleaved with
plain decoding. The sizes with the best tokens/s, on targets of different weight types, set the
converter's default rule (convert.default_draft_vocab).

    .venv/bin/python benchmarks/draft_vocab.py [--sizes 512,1024,2048,4096,8192,0] [--types f16,q8_0] [-N 8] [-n 96]

Prints a markdown table and writes JSON (default bench-out/draft_vocab.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import heads, models
from eagle_llamacpp.bench import pick_questions, plain_greedy
from eagle_llamacpp.engine import EagleLlama, Sampling
from eagle_llamacpp.chat import ChatRenderer
from eagle_llamacpp.stats import SpecStats


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="512,1024,2048,4096,8192,0", help="draft vocabulary sizes (0: the whole one)")
    p.add_argument("--types", default="f16", help="draft weight types (convert_eagle.py --outtype)")
    p.add_argument("--tree", default="6,4,2", help="TOTAL,DEPTH,TOP_K of the fixed tree")
    p.add_argument("-N", "--n-prompts", type=int, default=8)
    p.add_argument("-n", "--n-predict", type=int, default=96)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", default="bench-out/draft_vocab.json")
    args = p.parse_args()

    target = models.fetch(models.QWEN25_CODER_05B)
    head = heads.shipped_head(models.QWEN25_CODER_05B)
    tree = tuple(int(v) for v in args.tree.split(","))
    drafts = [(int(n), t) for n in args.sizes.split(",") for t in args.types.split(",")]
    engines = {d: EagleLlama(target, heads.draft_gguf(head, target, d[0], d[1]), n_threads=args.threads, tree=tree)
               for d in drafts}
    first = engines[drafts[0]]
    renderer = ChatRenderer(first.target)
    prompts = [renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}])
               for q in pick_questions(args.n_prompts)]
    plain = {"tokens": 0, "s": 0.0}
    rows = {d: {"tokens": 0, "s": 0.0, "stats": SpecStats(), "same": 0} for d in drafts}
    for prompt in prompts:
        want, plain_s = plain_greedy(first, prompt, args.n_predict)
        plain["tokens"] += len(want)
        plain["s"] += plain_s
        for d, llm in engines.items():
            row = rows[d]
            prompt_s = row["stats"].prompt_s
            t0 = time.perf_counter()
            got = list(llm.generate(prompt, args.n_predict, Sampling(temperature=0.0), row["stats"]))
            row["s"] += time.perf_counter() - t0 - (row["stats"].prompt_s - prompt_s)
            row["tokens"] += len(got)
            row["same"] += got == want
    for llm in engines.values():
        llm.close()

    plain_tps = plain["tokens"] / plain["s"]
    out = {"target": target.name, "tree": tree, "n_prompts": len(prompts), "plain_tokens_per_s": plain_tps,
           "drafts": {}}
    print(f"| draft vocabulary | weights | tokens/s | x plain | acceptance length | draft ms per round | "
          f"same as plain (of {len(prompts)}) |\n|---|---|---|---|---|---|---|")
    for (n, wtype), row in rows.items():
        st = row["stats"]
        tps = row["tokens"] / row["s"]
        out["drafts"][f"{n}-{wtype}"] = {"draft_vocab": n, "weights": wtype, "tokens_per_s": tps,
                                         "speedup_vs_plain": tps / plain_tps,
                                         "acceptance_length": st.mean_acceptance_length,
                                         "draft_ms_per_round": st.draft_s * 1e3 / st.rounds,
                                         "same_as_plain": row["same"]}
        print(f"| {n or 'whole (151,936)'} | {wtype} | {tps:.2f} | {tps / plain_tps:.2f} | "
              f"{st.mean_acceptance_length:.2f} | "
              f"{st.draft_s * 1e3 / st.rounds:.2f} | {row['same']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
