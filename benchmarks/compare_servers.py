#!/usr/bin/env python3
"""llama-server's EAGLE-2 with two builds (a patch's before and after) and llama-server without
speculation with each build (server-plain is the after build's), on MT-bench first turns, greedy:
each prompt goes to every server in turn (the first server rotates), so that a change of machine
load hits them all alike.

    .venv/bin/python benchmarks/compare_servers.py --bin <before>/bin --bin build/bin
        [--models qwen2.5-coder-0.5b | --target x.gguf] [--head heads/... | -md draft.gguf] [-N 16] [-n 128]

A --bin folder holds llama-server and its libraries (a build's bin folder); each server loads the
libraries of its own folder. Prints a markdown table (tokens/s, x llama-server without speculation,
acceptance, and whether each server's tokens are llama-server-without-speculation's) and writes
JSON (default bench-out/compare_servers.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EAGLE2_ARGS = ["--spec-type", "draft-eagle2", "--spec-draft-n-max", "6", "--spec-eagle2-depth", "5",
               "--spec-eagle2-top-k", "4"]  # as `eagle-llamacpp bench` runs server-eagle2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, action="append", help="a build's bin folder; give two (before, after)")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", type=Path, help="a GGUF of your own instead of --models")
    ap.add_argument("--head", type=Path, help="head folder (default: the shipped head of --models)")
    ap.add_argument("-md", "--draft", type=Path, help="a draft GGUF instead of --head")
    ap.add_argument("--draft-vocab", type=int, default=None,
                    help="draft vocabulary the head is converted with (default: the converter's, sized to the target)")
    ap.add_argument("-N", "--prompts", type=int, default=16)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--out", type=Path, default=Path("bench-out/compare_servers.json"))
    args = ap.parse_args()
    if not args.bin or len(args.bin) != 2:
        ap.error("give --bin twice: the build before, then the build after")
    for b in args.bin:
        if not (b / "llama-server").exists():
            ap.error(f"{b} holds no llama-server")

    from eagle_llamacpp import heads, models
    from eagle_llamacpp.bench import ServerMethods, pick_questions, summarize
    from eagle_llamacpp.chat import ChatRenderer
    from eagle_llamacpp.draft import TargetModel
    from report import print_table, write_json

    target = args.target or models.fetch(models.MODELS[args.models])
    draft = args.draft or heads.draft_gguf(args.head or heads.shipped_head(models.MODELS[args.models]), target,
                                           draft_vocab=args.draft_vocab)
    questions = pick_questions(args.prompts)
    model = TargetModel(target, n_ctx=512, n_threads=1)
    renderer = ChatRenderer(model)
    prompts = [renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}]) for q in questions]
    model.close()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    eagle2 = ["-md", str(draft), *EAGLE2_ARGS]
    # plain decoding with both builds too: a kernel or memory patch changes it as well
    servers = {"server-plain": [], "server-plain-before": [], "before": eagle2, "after": eagle2}
    bins = {"server-plain": args.bin[1], "server-plain-before": args.bin[0], "before": args.bin[0],
            "after": args.bin[1]}
    srv = ServerMethods(target, servers, args.threads, 2048, args.out.parent, bin_dirs=bins)
    results = []
    try:
        names = srv.names()
        for name in names:  # warm-up: the first request allocates
            srv.run(name, prompts[0][:32], 8, questions[0])
        for i, (q, tokens) in enumerate(zip(questions, prompts)):
            for name in names[i % len(names):] + names[:i % len(names)]:
                results.append(srv.run(name, tokens, args.max_tokens, q))
            print(f"  prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    finally:
        srv.close()
    summary = summarize(results, names)
    rows = [dict(method=name, bin=str(bins[name]), **{k: v for k, v in summary[name].items() if k != "by_category"})
            for name in names]
    print_table(["method", "tokens/s", "x server-plain", "acceptance length", "draft accepted",
                 f"same tokens as server-plain (of {len(prompts)})"],
                [[r["method"], f"{r['tokens_per_s']:.2f}", f"{r['speedup_vs_server-plain']:.3f}",
                  f"{r['acceptance_length']:.2f}", "-" if r["draft_acceptance_rate"] is None else f"{r['draft_acceptance_rate']:.0%}",
                  r["same_tokens_as_server_plain"]] for r in rows])
    write_json(args.out, rows, bins=[str(b) for b in args.bin], target=Path(target).name, draft=Path(draft).name,
               prompts=len(prompts), max_tokens=args.max_tokens, threads=args.threads)


if __name__ == "__main__":
    main()
