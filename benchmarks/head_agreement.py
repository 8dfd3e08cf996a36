#!/usr/bin/env python3
"""How often heads draft the token the target emits, on the target's own MT-bench replies.

The target answers every MT-bench first turn greedily (as self-distillation does, 16 replies per
decode; the features are kept in a cache folder), then each head runs over those features as the
draft does: step-1 top-1 as training counts it (argmax within the training draft vocabulary)
and as inference does (the emitted token, within the draft GGUF's vocabulary), and the acceptance
length of a fixed chain of 1..3 drafted tokens. Thousands of positions per run, so heads a few
hundredths apart separate, where `head_acceptance.py`'s few hundred rounds do not. The replies are
evaluation data only: training excludes MT-bench questions.

    .venv/bin/python benchmarks/head_agreement.py -m TARGET.gguf --head shipped=heads/... \
        --head new=work/head [--draft-vocab 2048,16384]

Prints a markdown table and writes JSON (default bench-out/head_agreement.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eagle_llamacpp import cli, data
from eagle_llamacpp.checkpoint import load_head
from eagle_llamacpp.constants import DRAFT_VOCAB_FILE
from eagle_llamacpp.convert import read_draft_vocab
from eagle_llamacpp.training import agreement, distill
from eagle_llamacpp.training.features import read_manifest
from eagle_llamacpp.training.head_model import EagleHeadNet, HeadConfig
from eagle_llamacpp.training.shards import ShardStream
from eagle_llamacpp.training.train import target_tensors


def mtbench_replies(target: Path, folder: Path, max_len: int, threads: int) -> ShardStream:
    """The target's greedy replies to MT-bench first turns, with their features (made once)."""
    if not (folder / "manifest.json").exists():
        convs = [[{"role": "user", "content": q.turns[0]}] for q in data.mtbench_questions()]
        model = cli.extraction_target(SimpleNamespace(max_len=max_len, threads=threads, distill_seqs=cli.EXTRACT_SEQS),
                                       target, streams=True)
        try:
            distill.generate(model, convs, folder, max_tokens=max_len, token_budget=10**9)
        finally:
            model.close()
    return ShardStream([folder / s for s in read_manifest(folder)["shards"]])


def head_net(target: Path, head_dir: Path) -> tuple[EagleHeadNet, np.ndarray]:
    head = load_head(head_dir)
    cfg = HeadConfig.from_target(target)
    net = EagleHeadNet(replace(cfg, intermediate_size=head.intermediate_size))
    net.load_head(head.tensors)
    draft_vocab = read_draft_vocab(head_dir, cfg.vocab_size)
    if draft_vocab is None:
        raise SystemExit(f"{head_dir}: no {DRAFT_VOCAB_FILE} (the head's target tokens by frequency)")
    return net, np.asarray(draft_vocab, np.int64)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--target", required=True)
    p.add_argument("--head", action="append", required=True, help="LABEL=HEAD_DIR (HF layout), repeatable")
    p.add_argument("--draft-vocab", default="2048,16384",
                   help="draft vocabulary sizes to measure; the first gets the per-position figures")
    p.add_argument("--steps", type=int, default=3, help="deepest chain measured")
    p.add_argument("--max-len", type=int, default=384, help="prompt + reply tokens per question")
    p.add_argument("--replies", help="cache folder of the replies' features (default: bench-out/mtbench-replies-<target>)")
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-o", "--out", default="bench-out/head_agreement.json")
    args = p.parse_args()

    target = Path(args.target)
    folder = Path(args.replies or f"bench-out/mtbench-replies-{target.stem}")
    stream = mtbench_replies(target, folder, args.max_len, args.threads)
    emb, lm_head = target_tensors(target)
    sizes = tuple(int(v) for v in args.draft_vocab.split(","))
    results = {}
    for spec in args.head:
        label, _, path = spec.partition("=")
        net, draft_vocab = head_net(target, Path(path))
        results[label] = agreement.measure(net, stream, emb, lm_head, draft_vocab, sizes, args.steps)

    print(f"Target: {target.name}; {len(stream)} MT-bench replies, "
          f"{next(iter(results.values()))['positions']} drafted positions\n")
    print("| head | draft vocabulary | emitted token in it | top-1 as trained | top-1 (emitted) | "
          + " | ".join(f"chain of {d}: acceptance length" for d in range(1, args.steps + 1)) + " |")
    print("|---|---|---|---|---|" + "---|" * args.steps)
    for label, r in results.items():
        for k, v in r["sizes"].items():
            print(f"| {label} | {k} | {v['emitted_in_vocab']:.3f} | {v['top1_as_trained']:.3f} | {v['top1']:.3f} | "
                  + " | ".join(f"{a:.3f}" for a in v["chain_acceptance_length"]) + " |")
    print(f"\nTop-1 (emitted, draft vocabulary {sizes[0]}) by position in the reply, {agreement.POSITION_BIN}-token bins:\n")
    bins = list(next(iter(results.values()))["top1_by_reply_position"])
    print("| head | " + " | ".join(f"from {b}" for b in bins) + " |")
    print("|---|" + "---|" * len(bins))
    for label, r in results.items():
        print(f"| {label} | " + " | ".join(f"{r['top1_by_reply_position'].get(b, 0):.2f}" for b in bins) + " |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"target": target.name, "replies": len(stream), "heads": results}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
