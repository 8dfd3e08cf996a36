#!/usr/bin/env python3
"""What flash attention (or weight repacking) does to decoding on this machine: one token and verify
batches of N tokens after contexts of several lengths, with the setting on and off, plus prompt
batches of 32, 128 and 512 tokens (feature extraction and self-distillation decode such batches).
Both settings run in one process, interleaved (per repetition: every context length, every size,
then every prompt batch, on then off), so a change of machine load hits both alike.

    .venv/bin/python benchmarks/flash_attn.py [--models qwen2.5-coder-0.5b | --target x.gguf] [--reps 5]
        [--compare repack]

`--compare repack` times ggml's weight repacking (llama.cpp's extra buffer types: AMX on Intel Xeons)
on and off instead, flash attention on. Prints a markdown table (median ms, off / on) and writes JSON
(default bench-out/flash_attn.json, or bench-out/repack.json).
EagleLlama keeps flash attention on (llama.cpp's default) all the same: with it off, a tree node
off the first branch sums its attention in other groups of cells than one-token decoding (README,
Known limits).
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
PROMPT_SIZES = (32, 128, 512)
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


def load_target(path: Path, n_threads: int, setting: str, on: bool) -> TargetModel:
    n_ctx = max(CONTEXTS) + max(SIZES) + 16
    if setting == "flash-attn":
        return TargetModel(path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads, flash_attn=on)
    return TargetModel(path, n_ctx=n_ctx, n_batch=512, n_threads=n_threads, repack=on)


def bench_model(name: str, path: Path, reps: int, n_threads: int, setting: str = "flash-attn") -> list[dict]:
    targets = {on: load_target(path, n_threads, setting, on) for on in (True, False)}
    rng = np.random.default_rng(0)
    history = rng.integers(0, targets[True].n_vocab, max(CONTEXTS))
    times = {(on, c, n): [] for on in targets for c in CONTEXTS for n in SIZES}
    pp = {(on, n): [] for on in targets for n in PROMPT_SIZES}
    for rep in range(reps + 1):  # repetition 0 allocates the graphs
        for c in CONTEXTS:
            for on, target in targets.items():
                prefill(target, history[:c])
            for n in SIZES:
                for on, target in targets.items():
                    ms = verify_ms(target, c, n, rng)
                    if rep:
                        times[on, c, n].append(ms)
        for n in PROMPT_SIZES:
            for on, target in targets.items():
                ms = prompt_ms(target, history[:n])
                if rep:
                    pp[on, n].append(ms)
        print(f"  {name}: repetition {rep}/{reps}", file=sys.stderr)
    for target in targets.values():
        target.close()
    rows = []
    for c in CONTEXTS:
        for n in SIZES:
            on, off = statistics.median(times[True, c, n]), statistics.median(times[False, c, n])
            rows.append(dict(model=name, context=c, n=n, on_ms=on, off_ms=off, off_over_on=off / on))
    for n in PROMPT_SIZES:
        on, off = statistics.median(pp[True, n]), statistics.median(pp[False, n])
        rows.append(dict(model=name, context=0, n=n, on_ms=on, off_ms=off, off_over_on=off / on))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], choices=list(models.MODELS))
    ap.add_argument("--target", type=Path, help="a GGUF of your own instead of --models")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--compare", choices=["flash-attn", "repack"], default="flash-attn")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out = args.out or Path(f"bench-out/{args.compare.replace('-', '_')}.json")

    targets = ({args.target.name: args.target} if args.target else
               {name: models.fetch(models.MODELS[name]) for name in args.models})
    rows = [r for name, path in targets.items()
            for r in bench_model(name, path, args.reps, args.threads, args.compare)]
    label = "flash attention" if args.compare == "flash-attn" else "repacking"
    print_table(["model", "context", "tokens decoded", f"{label} on, ms", "off, ms", "off / on"],
                [[r["model"], "prompt batch" if r["context"] == 0 else r["context"], r["n"], f"{r['on_ms']:.1f}",
                  f"{r['off_ms']:.1f}", f"{r['off_over_on']:.2f}"] for r in rows])
    write_json(out, rows, threads=args.threads, reps=args.reps, statistic="median", compare=args.compare)

if __name__ == "__main__":
    main()
