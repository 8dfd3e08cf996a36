#!/usr/bin/env python3
"""llama-server's EAGLE-2 with two builds (a patch's before and after) and llama-server without
speculation, on MT-bench first turns, greedy: each prompt goes to every server in turn (the first
server rotates), so that a change of machine load hits them all alike.

    .venv/bin/python benchmarks/compare_servers.py --bin <before>/bin --bin build/bin
        [--models qwen2.5-coder-0.5b | --target x.gguf] [--head heads/... | -md draft.gguf] [-N 16] [-n 128]

A --bin folder holds llama-server and its libraries (a build's bin folder); each server loads the
libraries of its own folder. Prints a markdown table (tokens/s, x llama-server without speculation,
acceptance) and writes JSON (default bench-out/compare_servers.json).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EAGLE2_ARGS = ["--spec-type", "draft-eagle2", "--spec-draft-n-max", "6", "--spec-eagle2-depth", "5",
               "--spec-eagle2-top-k", "4"]  # as `eagle-llamacpp bench` runs server-eagle2


def start_server(bin_dir: Path, target: Path, extra_args: list[str], n_threads: int, log_path: Path):
    """A llama-server of bin_dir, loading bin_dir's libraries (its RUNPATH names the build it came from)."""
    from eagle_llamacpp import llama_server

    saved = os.environ.get("LD_LIBRARY_PATH"), llama_server.library_dir
    os.environ["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(bin_dir), saved[0]]))
    llama_server.library_dir = lambda: bin_dir
    try:
        return llama_server.LlamaServer(target, extra_args, n_threads=n_threads, log_path=log_path)
    finally:
        llama_server.library_dir = saved[1]
        if saved[0] is None:
            del os.environ["LD_LIBRARY_PATH"]
        else:
            os.environ["LD_LIBRARY_PATH"] = saved[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", type=Path, action="append", help="a build's bin folder; give two (before, after)")
    ap.add_argument("--models", default="qwen2.5-coder-0.5b")
    ap.add_argument("--target", type=Path, help="a GGUF of your own instead of --models")
    ap.add_argument("--head", type=Path, help="head folder (default: the shipped head of --models)")
    ap.add_argument("-md", "--draft", type=Path, help="a draft GGUF instead of --head")
    ap.add_argument("--draft-vocab", type=int, default=2048)
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

    from eagle_llamacpp import bench, heads, models
    from eagle_llamacpp.chat import ChatRenderer
    from eagle_llamacpp.draft import TargetModel
    from report import print_table, write_json

    target = args.target or models.fetch(models.MODELS[args.models])
    draft = args.draft or heads.draft_gguf(args.head or heads.shipped_head(models.MODELS[args.models]), target,
                                           draft_vocab=args.draft_vocab)
    model = TargetModel(target, n_ctx=512, n_threads=1)
    renderer = ChatRenderer(model)
    prompts = [renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}])
               for q in bench.pick_questions(args.prompts)]
    model.close()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    specs = {"server-plain": (args.bin[1], []), "before": (args.bin[0], ["-md", str(draft), *EAGLE2_ARGS]),
             "after": (args.bin[1], ["-md", str(draft), *EAGLE2_ARGS])}
    servers = {}
    try:
        for name, (bin_dir, extra) in specs.items():
            servers[name] = start_server(bin_dir.resolve(), target, extra, args.threads,
                                         args.out.parent / f"compare_servers-{name}.log")
        names = list(servers)
        for name in names:  # warm-up: the first request allocates
            servers[name].complete(prompts[0][:32], 8)
        totals = {name: dict(tokens=0, ms=0.0, drafted=0, accepted=0) for name in names}
        for i, tokens in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = servers[name].complete(tokens, args.max_tokens)["timings"]
                totals[name]["tokens"] += int(t["predicted_n"])
                totals[name]["ms"] += float(t["predicted_ms"])
                totals[name]["drafted"] += int(t.get("draft_n", 0))
                totals[name]["accepted"] += int(t.get("draft_n_accepted", 0))
            print(f"  prompt {i + 1}/{len(prompts)}", file=sys.stderr)
    finally:
        for s in servers.values():
            s.close()
    plain = totals["server-plain"]["tokens"] / totals["server-plain"]["ms"]
    rows = []
    for name, t in totals.items():
        rate = t["tokens"] / t["ms"]
        rounds = t["tokens"] - t["accepted"]  # every round emits its accepted draft tokens plus one
        rows.append(dict(method=name, bin=str(specs[name][0]), tokens_per_s=rate * 1e3, x_plain=rate / plain,
                         acceptance_length=t["tokens"] / max(rounds, 1), **t))
    print_table(["method", "tokens/s", "x server-plain", "acceptance length", "drafted", "accepted"],
                [[r["method"], f"{r['tokens_per_s']:.2f}", f"{r['x_plain']:.3f}", f"{r['acceptance_length']:.2f}",
                  r["drafted"], r["accepted"]] for r in rows])
    write_json(args.out, rows, bins=[str(b) for b in args.bin], target=Path(target).name, draft=Path(draft).name,
               prompts=len(prompts), max_tokens=args.max_tokens, threads=args.threads)


if __name__ == "__main__":
    main()
