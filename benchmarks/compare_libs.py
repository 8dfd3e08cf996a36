#!/usr/bin/env python3
"""Decode costs of the same target with two builds of the patched library (a patch's before and after):
one token and verify batches of N tokens after a few context lengths. A library loads once per
process, so each build runs in its own worker process; the workers take turns, round after round, so
that a change of machine load hits both alike.

    .venv/bin/python benchmarks/compare_libs.py --lib <before>/bin --lib build/bin
        [--models qwen2.5-coder-0.5b | --target x.gguf] [--rounds 3] [--reps 3]

A --lib folder holds libllama and libggml* (a build's bin folder). Prints a markdown table (median ms
over every round's medians, and before / after) and writes JSON (default bench-out/compare_libs.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
CONTEXTS = (160, 600)


def worker(target: Path, reps: int, n_threads: int) -> dict:
    """Median ms per (context, size) in this process's library."""
    from eagle_llamacpp.bench import prefill
    from eagle_llamacpp.draft import TargetModel
    from flash_attn import verify_ms

    model = TargetModel(target, n_ctx=max(CONTEXTS) + max(SIZES) + 16, n_batch=512, n_threads=n_threads)
    rng = np.random.default_rng(0)
    history = rng.integers(0, model.n_vocab, max(CONTEXTS))
    out = {}
    for c in CONTEXTS:
        prefill(model, history[:c])
        times = {n: [] for n in SIZES}
        for rep in range(reps + 1):  # repetition 0 allocates the graphs
            for n in SIZES:
                ms = verify_ms(model, c, n, rng)
                if rep:
                    times[n].append(ms)
        out.update({f"{c}/{n}": statistics.median(v) for n, v in times.items()})
    model.close()
    return out


def run_worker(lib: Path, target: Path, reps: int, n_threads: int) -> dict:
    env = dict(os.environ, EAGLE_LLAMACPP_LIB=str(lib),
               LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")])))
    cmd = [sys.executable, __file__, "--worker", "--target", str(target), "--reps", str(reps),
           "--threads", str(n_threads)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"worker with {lib} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", type=Path, action="append", help="a library folder; give two (before, after)")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", type=Path, help="a GGUF of your own instead of --models")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/compare_libs.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        print(json.dumps(worker(args.target, args.reps, args.threads)))
        return
    if not args.lib or len(args.lib) != 2:
        ap.error("give --lib twice: the build before, then the build after")
    for lib in args.lib:
        if not any(lib.glob("libllama.*")):
            ap.error(f"{lib} holds no libllama")
    from eagle_llamacpp import models
    from report import print_table, write_json

    target = args.target or models.fetch(models.MODELS[args.models])
    results = {0: [], 1: []}
    for r in range(args.rounds):
        for i, lib in enumerate(args.lib):
            results[i].append(run_worker(lib.resolve(), target, args.reps, args.threads))
        print(f"  round {r + 1}/{args.rounds}", file=sys.stderr)
    rows = []
    for key in results[0][0]:
        before = statistics.median(x[key] for x in results[0])
        after = statistics.median(x[key] for x in results[1])
        c, n = (int(v) for v in key.split("/"))
        one = statistics.median(x[f"{c}/1"] for x in results[1])
        rows.append(dict(context=c, n=n, before_ms=before, after_ms=after, before_over_after=before / after,
                         after_over_one_token=after / one))
    print_table(["context", "tokens decoded", "before, ms", "after, ms", "before / after", "after, x one token"],
                [[r["context"], r["n"], f"{r['before_ms']:.1f}", f"{r['after_ms']:.1f}",
                  f"{r['before_over_after']:.2f}", f"{r['after_over_one_token']:.2f}"] for r in rows])
    write_json(args.out, rows, libs=[str(p) for p in args.lib], target=Path(target).name, threads=args.threads,
               rounds=args.rounds, reps=args.reps, statistic="median of per-round medians")


if __name__ == "__main__":
    main()
