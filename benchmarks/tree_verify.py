#!/usr/bin/env python3
"""What one tree verification costs: a tree of N nodes vs a chain of N tokens vs one token.

Every size is measured interleaved (tree, chain, one token, repeat), so the ratios compare runs made
under the same machine load. All N tokens produce logits, as a verification needs them.

    .venv/bin/python benchmarks/tree_verify.py [--models smollm2-135m qwen2.5-coder-0.5b] [--reps 5]

Prints a markdown table and writes JSON (default bench-out/tree_verify.json).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import _native as nat
from eagle_llamacpp import models
from eagle_llamacpp.draft import TargetModel
from report import print_table, write_json

SIZES = (1, 2, 4, 8, 16, 32, 48, 64)
PROMPT = ("Write a Python function that parses a CSV file of orders, groups them by customer and "
          "returns the total amount per customer, sorted from largest to smallest. ") * 3


def eagle_like_tree(rng, n_nodes: int, top_k: int = 4, max_depth: int = 6):
    """Parents and depths of a tree shaped like an EAGLE-2 draft: wide near the root, thin deeper."""
    parents, depth, n_children = [-1], [0], [0]
    while len(parents) < n_nodes:
        # prefer shallow nodes with room for another child
        cand = [i for i in range(len(parents)) if depth[i] < max_depth and n_children[i] < top_k]
        weights = np.array([0.5 ** depth[i] for i in cand])
        p = int(rng.choice(cand, p=weights / weights.sum()))
        parents.append(p)
        depth.append(depth[p] + 1)
        n_children.append(0)
        n_children[p] += 1
    return np.array(parents), np.array(depth)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t0) * 1e3


def bench_model(name: str, reps: int, n_threads: int, rng) -> list[dict]:
    target = TargetModel(models.fetch(models.MODELS[name]), n_ctx=1024, n_batch=128, n_threads=n_threads)
    prompt = target.tokenize(PROMPT)[:128]
    target.decode(prompt, np.arange(len(prompt)), outputs=np.zeros(len(prompt), np.int8))
    p = len(prompt)
    vocab = target.n_vocab

    def chain(n):
        target.decode(rng.integers(0, vocab, n), p + np.arange(n))
        nat.seq_rm(target.ctx, 0, p)

    def tree(n, parents, depth):
        target.decode(rng.integers(0, vocab, n), p + depth, tree=(np.arange(n), parents))
        target.tree_commit([])

    rows = []
    for n in SIZES:
        parents, depth = eagle_like_tree(rng, n)
        t_tree, t_chain, t_one = [], [], []
        tree(n, parents, depth)  # warm-up: graph allocation for this size
        chain(n)
        for _ in range(reps):
            t_tree.append(timed(tree, n, parents, depth))
            t_chain.append(timed(chain, n))
            t_one.append(timed(chain, 1))
        row = dict(model=name, n=n, depth=int(depth.max()), tree_ms=statistics.median(t_tree),
                   chain_ms=statistics.median(t_chain), one_ms=statistics.median(t_one))
        row["tree_over_chain"] = row["tree_ms"] / row["chain_ms"]
        row["tree_over_one"] = row["tree_ms"] / row["one_ms"]
        rows.append(row)
        print(f"  {name} N={n}: tree {row['tree_ms']:.1f} ms, chain {row['chain_ms']:.1f} ms", file=sys.stderr)
    target.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(models.MODELS), choices=list(models.MODELS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/tree_verify.json"))
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    rows = [r for name in args.models for r in bench_model(name, args.reps, args.threads, rng)]

    print_table(["model", "N", "tree depth", "tree ms", "chain ms", "one token ms", "tree / chain", "tree / one token"],
                [[r["model"], r["n"], r["depth"], f"{r['tree_ms']:.1f}", f"{r['chain_ms']:.1f}", f"{r['one_ms']:.1f}",
                  f"{r['tree_over_chain']:.2f}", f"{r['tree_over_one']:.2f}"] for r in rows])
    write_json(args.out, rows, threads=args.threads, reps=args.reps, prompt_tokens=128, statistic="median")

if __name__ == "__main__":
    main()
