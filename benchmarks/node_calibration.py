#!/usr/bin/env python3
"""How well a head's draft probabilities predict acceptance, per kind of drafted node.

Drafts a fixed tree every round over MT-bench first turns (greedy) and, for each drafted node,
compares its cumulative draft probability with whether the target accepted it. The ratio of
accepted to predicted nodes per kind is what tree="auto" calibrates (autotune.AutoPolicy): the
likeliest node, its depth-1 siblings, and each deeper level.

    .venv/bin/python benchmarks/node_calibration.py -m TARGET.gguf --head heads/... [--tree 10,3,3]

Prints a markdown table and writes JSON (default bench-out/node_calibration.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import heads
from eagle_llamacpp.bench import pick_questions
from eagle_llamacpp.chat import ChatRenderer
from eagle_llamacpp.engine import EagleLlama, Sampling
from eagle_llamacpp.stats import SpecStats


def node_rows(tree, path) -> list[tuple[int, int, float, int]]:
    """(depth, rank by draft probability, cumulative draft probability, accepted) per drafted node."""
    ranks = np.empty(tree.n - 1, np.int64)
    ranks[np.argsort(-tree.scores[1:], kind="stable")] = np.arange(tree.n - 1)
    accepted = set(int(i) for i in path[1:])
    depths = tree.depths
    return [(int(depths[i]), int(ranks[i - 1]), float(np.exp(tree.scores[i])), int(i in accepted))
            for i in range(1, tree.n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--target", required=True)
    p.add_argument("--head", required=True, help="head folder (HF layout)")
    p.add_argument("--tree", default="10,3,3", help="TOTAL,DEPTH,TOP_K of the fixed tree")
    p.add_argument("--draft-vocab", type=int, default=2048)
    p.add_argument("-N", "--n-prompts", type=int, default=16)
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", default="bench-out/node_calibration.json")
    args = p.parse_args()

    draft = heads.draft_gguf(Path(args.head), Path(args.target), draft_vocab=args.draft_vocab)
    llm = EagleLlama(args.target, draft, n_threads=args.threads, tree=tuple(int(v) for v in args.tree.split(",")))
    rows: list[tuple[int, int, float, int]] = []
    llm.on_round = lambda tree, path: rows.extend(node_rows(tree, path)) if tree.n > 1 else None
    renderer = ChatRenderer(llm.target)
    for q in pick_questions(args.n_prompts):
        prompt = renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}])
        list(llm.generate(prompt, args.n_predict, Sampling(temperature=0.0), SpecStats()))
    llm.close()

    a = np.asarray(rows, np.float64).reshape(-1, 4)
    kinds = {"likeliest node": a[:, 1] == 0, "other depth-1 nodes": (a[:, 0] == 1) & (a[:, 1] > 0)}
    for d in range(2, int(a[:, 0].max(initial=1)) + 1):
        kinds[f"depth {d}"] = a[:, 0] == d
    table = {name: {"nodes": int(m.sum()), "accepted": int(a[m, 3].sum()), "predicted": round(float(a[m, 2].sum()), 1),
                    "ratio": round(float(a[m, 3].sum() / max(a[m, 2].sum(), 1e-9)), 3)} for name, m in kinds.items()}
    print("| nodes | drafted | accepted | predicted (sum of draft probabilities) | accepted / predicted |")
    print("|---|---|---|---|---|")
    for name, r in table.items():
        print(f"| {name} | {r['nodes']} | {r['accepted']} | {r['predicted']} | {r['ratio']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "kinds": table, "rows": rows}) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
