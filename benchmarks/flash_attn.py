#!/usr/bin/env python3
"""What flash attention does to decoding on this machine: one token and verify batches of N tokens
after contexts of several lengths, with llama.cpp's flash attention on and off, plus a 512-token
prompt batch. Both settings run in one process, interleaved (per repetition: every context length,
every size, on then off), so a change of machine load hits both alike.

    .venv/bin/python benchmarks/flash_attn.py [--models qwen2.5-coder-0.5b | --target x.gguf] [--reps 5]

Prints a markdown table (median ms, off / on) and writes JSON (default bench-out/flash_attn.json).
EagleLlama keeps llama.cpp's default (on) all the same: with it off, a tree node off the first
branch sums its attention in other groups of cells than one-token decoding (README, Known limits).
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
from eagle_llamacpp.bench import prefill
from eagle_llamacpp.draft import TargetModel
from report import print_table, write_json

SIZES = (1, 2, 4, 8)
CONTEXTS = (128, 512, 1024)


def verify_ms(target: TargetModel, n_past: int, n: int, rng) -> float:
    """One verify of an n-token chain-shaped tree (every token with logits), then dropped."""
    tokens = rng.integers(0, target.n_vocab, n)
    t0 = time.perf_counter()
    target.decode(tokens, n_past + np.arange(n), tree=(np.arange(n), np.arange(n) - 1))
    ms = (time.perf_counter() - t0) * 1e3
    target.tree_commit([])
    return ms


def prompt_ms(target: TargetModel, tokens: np.ndarray) -> float:
    nat.clear_memory(target.ctx)
    t0 = time.perf_counter()
    target.decode(tokens, np.arange(len(tokens)), outputs=np.zeros(len(tokens), np.int8))
    return (time.perf_counter() - t0) * 1e3


def bench_model(name: str, path: Path, reps: int, n_threads: int) -> list[dict]:
    n_ctx = max(CONTEXTS) + max(SIZES) + 16
    targets = {fa: TargetModel(path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads, flash_attn=fa)
               for fa in (True, False)}
    rng = np.random.default_rng(0)
    history = rng.integers(0, targets[True].n_vocab, max(CONTEXTS))
    times = {(fa, c, n): [] for fa in targets for c in CONTEXTS for n in SIZES}
    pp = {fa: [] for fa in targets}
    for rep in range(reps + 1):  # repetition 0 allocates the graphs
        for c in CONTEXTS:
            for fa, target in targets.items():
                prefill(target, history[:c])
            for n in SIZES:
                for fa, target in targets.items():
                    ms = verify_ms(target, c, n, rng)
                    if rep:
                        times[fa, c, n].append(ms)
        for fa, target in targets.items():
            ms = prompt_ms(target, history[:512])
            if rep:
                pp[fa].append(ms)
        print(f"  {name}: repetition {rep}/{reps}", file=sys.stderr)
    for target in targets.values():
        target.close()
    rows = []
    for c in CONTEXTS:
        for n in SIZES:
            on, off = statistics.median(times[True, c, n]), statistics.median(times[False, c, n])
            rows.append(dict(model=name, context=c, n=n, on_ms=on, off_ms=off, off_over_on=off / on))
    on, off = statistics.median(pp[True]), statistics.median(pp[False])
    rows.append(dict(model=name, context=0, n=512, on_ms=on, off_ms=off, off_over_on=off / on))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], choices=list(models.MODELS))
    ap.add_argument("--target", type=Path, help="a GGUF of your own instead of --models")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/flash_attn.json"))
    args = ap.parse_args()

    targets = ({args.target.name: args.target} if args.target else
               {name: models.fetch(models.MODELS[name]) for name in args.models})
    rows = [r for name, path in targets.items() for r in bench_model(name, path, args.reps, args.threads)]
    print_table(["model", "context", "tokens decoded", "flash attention on, ms", "off, ms", "off / on"],
                [[r["model"], "prompt batch" if r["context"] == 0 else r["context"], r["n"], f"{r['on_ms']:.1f}",
                  f"{r['off_ms']:.1f}", f"{r['off_over_on']:.2f}"] for r in rows])
    write_json(args.out, rows, threads=args.threads, reps=args.reps, statistic="median")

if __name__ == "__main__":
    main()
