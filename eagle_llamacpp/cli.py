"""eagle-llamacpp command line: `generate`, `convert` and `demo`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def cmd_demo(args) -> int:
    """The main job: EAGLE-2 with the shipped head on the default target, plain decoding beside it."""
    from . import heads, models
    from .bench import plain_greedy, top2_gap
    from .engine import EagleLlama, Sampling
    from .chat import ChatRenderer
    from .stats import SpecStats

    target_path = models.fetch(models.QWEN25_CODER_05B)
    draft_path = Path(args.draft) if args.draft else heads.draft_gguf(heads.shipped_head(models.QWEN25_CODER_05B),
                                                                       target_path, args.draft_vocab)
    llm = EagleLlama(target_path, draft_path, n_ctx=2048, n_threads=args.threads, tree=args.tree)
    try:
        prompt = ChatRenderer(llm.target).prompt_tokens([{"role": "user", "content": args.prompt}])
        plain_greedy(llm, prompt[:16], 4)  # warm-up: graphs, and the auto tree's latency table
        list(llm.generate(prompt[:16], 4, Sampling(temperature=0.0)))
        stats = SpecStats()
        t0 = time.perf_counter()
        out = list(llm.generate(prompt, args.n_predict, Sampling(temperature=0.0), stats))
        eagle_s = time.perf_counter() - t0 - stats.prompt_s
        plain, plain_s = plain_greedy(llm, prompt, args.n_predict)
        text = b"".join(llm._piece_bytes(t) for t in out if not llm.is_eog(t)).decode("utf-8", "replace")
        first_diff = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), None)
        gap = top2_gap(llm.target, prompt + plain[:first_diff]) if first_diff is not None else None
    finally:
        llm.close()
    print(f"{target_path.name} + {draft_path.name}, greedy, {args.threads} threads\n")
    print(f"> {args.prompt}\n\n{text}\n")
    eagle_tps, plain_tps = len(out) / eagle_s, len(plain) / plain_s
    print(f"EAGLE-2: {len(out)} tokens, {eagle_tps:.1f} tokens/s, mean acceptance length "
          f"{stats.mean_acceptance_length:.2f} tokens per target decode ({stats.rounds} decodes)")
    print(f"plain:   {len(plain)} tokens, {plain_tps:.1f} tokens/s (one token per decode)")
    print(f"speedup {eagle_tps / plain_tps:.2f}x; same text as plain decoding: {'yes' if out == plain else 'NO'}")
    if first_diff is not None:
        # ggml's CPU kernels round decodes of 8+ tokens differently from one-token decodes (engine.CPU_TREE)
        print(f"  the texts part at token {first_diff}, where the target's two best logits are {gap:.3f} apart "
              "(a near tie; ggml rounds verify batches of 8+ tokens differently from one-token decodes)")
    return 0


DEFAULT_TOKENS = 100_000  # train --tokens
EXTRACT_BATCH = 1024  # tokens per feature-extraction decode
EXTRACT_SEQS = 16     # conversations per feature-extraction decode, at most; --distill-seqs default


def make_features(args, target_path: Path, feature_dir: Path) -> tuple[list[Path], dict]:
    """ShareGPT features (its own replies), the target's own replies with --self-distill, or the
    sequences of other feature folders with --tokens-from; resumes from feature_dir. Returns the
    shards and how they were made (for the card)."""
    from . import data
    from .training import distill, features

    made_by = features.read_manifest(feature_dir)
    if args.tokens_from or "tokens_from" in made_by:
        if args.user_turn is not None:  # re-encoding keeps the sequences it is given
            raise SystemExit("--user-turn picks the prompts the target answers: re-encoded features "
                             "(--tokens-from) have none to pick")
        return reencoded_features(args, target_path, feature_dir)
    if not args.self_distill and "generated" in made_by:
        # a self-distilled folder (its manifest counts generated tokens): go on distilling into it
        # rather than add ShareGPT's replies, and say so on the card
        print(f"{feature_dir}: self-distilled features, so --self-distill", file=sys.stderr)
        args.self_distill = True
    if args.user_turn is None:  # a folder goes on with the turn it was made from
        args.user_turn = made_by.get("user_turn", 1)
    elif not args.self_distill:
        raise SystemExit("--user-turn picks the prompts the target answers: give --self-distill")
    if args.tokens is None:  # all that the folder holds, at least the default
        args.tokens = max(DEFAULT_TOKENS, made_by.get("n_tokens", 0))
    target = extraction_target(args, target_path, streams=args.self_distill)
    try:
        convs = data.training_conversations()
        what = "self-distilled replies" if args.self_distill else "ShareGPT features"
        print(f"{len(convs)} ShareGPT conversations (MT-bench questions excluded); "
              f"up to {args.tokens} tokens of {what}", file=sys.stderr)
        if args.self_distill:
            try:
                shards = distill.generate(target, convs, feature_dir, max_tokens=args.max_len,
                                          token_budget=args.tokens, temperature=args.distill_temp, seed=args.seed,
                                          first_conv=args.first_conversation, user_turn=args.user_turn)
            except ValueError as e:  # a folder of another turn, or a turn below 1
                raise SystemExit(str(e)) from None
        else:
            shards = features.extract(target, convs, feature_dir, max_tokens=args.max_len, token_budget=args.tokens,
                                      first_conv=args.first_conversation)
    except KeyboardInterrupt:
        raise stopped_making_features(feature_dir) from None
    finally:
        target.close()
    shards = first_tokens(shards, args.tokens)
    manifest = features.read_manifest(feature_dir)
    made = {"data": (f"self-distilled: the target's replies to ShareGPT {_ordinal(manifest.get('user_turn', 1))} "
                     f"user turns, temperature {args.distill_temp}") if args.self_distill else "ShareGPT replies",
            **folder_rates(manifest), "first_conversation": manifest.get("first_conv", 0)}
    if args.self_distill:
        made["generated_tokens_per_s"] = round(manifest["generated"] / max(manifest["seconds"], 1e-9), 1)
    print(f"features: {made['tokens']} tokens, {made['tokens_per_s']} tokens/s", file=sys.stderr)
    return shards, made


def stopped_making_features(feature_dir: Path) -> SystemExit:
    """Ctrl-C while features were made: what the folder keeps, and the exit status of an interrupt."""
    from .training import features

    stored = features.read_manifest(feature_dir).get("n_tokens", 0)
    print(f"stopped: {feature_dir} holds {stored} tokens; the same command goes on from there", file=sys.stderr)
    return SystemExit(130)


def _ordinal(n: int) -> str:
    return {1: "first", 2: "second", 3: "third"}.get(n, f"{n}th")


def several_folders(folders: list[Path]) -> tuple[list[Path], dict]:
    """The shards of finished feature folders, in order, and how they were made (for the card):
    a head goes over all the data made so far at once, e.g. after runs that each trained on one."""
    from .training import features

    manifests = [features.read_manifest(f) for f in folders]
    for folder, m in zip(folders, manifests):
        if not m.get("shards"):
            raise SystemExit(f"{folder}: no feature shards (several --features folders are only read; "
                             "make each one first)")
    kinds = sorted({"re-encoded" if "tokens_from" in m else "self-distilled" if "generated" in m else "ShareGPT"
                    for m in manifests})
    shards = [f / s for f, m in zip(folders, manifests) for s in m["shards"]]
    made = {"data": f"{' and '.join(kinds)} features of {len(folders)} folders at once",
            **folder_rates({"n_tokens": sum(m["n_tokens"] for m in manifests),
                            "seconds": sum(m["seconds"] for m in manifests)}),
            "folders": [{"folder": str(f), **{k: v for k, v in m.items()
                                              if k in ("first_conv", "next_conv", "n_tokens", "seconds")}}
                        for f, m in zip(folders, manifests)]}
    print(f"features: {made['tokens']} tokens in {len(folders)} folders", file=sys.stderr)
    return shards, made


def reencoded_features(args, target_path: Path, feature_dir: Path) -> tuple[list[Path], dict]:
    """The target's features for the sequences of the --tokens-from folders (see features.reencode)."""
    from .training import features

    made_by = features.read_manifest(feature_dir)
    sources = [Path(s) for s in (args.tokens_from or made_by["tokens_from"])]
    if args.tokens is None:
        args.tokens = max(DEFAULT_TOKENS, made_by.get("n_tokens", 0))
    target = extraction_target(args, target_path, streams=False)
    try:
        print(f"up to {args.tokens} tokens of features for the sequences of {', '.join(map(str, sources))}",
              file=sys.stderr)
        shards = features.reencode(target, sources, feature_dir, token_budget=args.tokens)
    except KeyboardInterrupt:
        raise stopped_making_features(feature_dir) from None
    finally:
        target.close()
    shards = first_tokens(shards, args.tokens)
    source_manifests = [features.read_manifest(s) for s in sources]
    data = sorted({"self-distilled replies" if "generated" in m else "ShareGPT replies" for m in source_manifests})
    folders = "1 feature folder" if len(sources) == 1 else f"{len(sources)} feature folders"
    made = {"data": f"{' and '.join(data)} of another model with this tokenizer ({folders}), re-encoded by "
                    "this target",
            **folder_rates(features.read_manifest(feature_dir)),
            "tokens_from": [{"folder": str(s), **{k: v for k, v in m.items()
                                                  if k in ("first_conv", "next_conv", "n_conv", "n_tokens")}}
                           for s, m in zip(sources, source_manifests)]}
    print(f"features: {made['tokens']} tokens, {made['tokens_per_s']} tokens/s", file=sys.stderr)
    return shards, made


def extraction_target(args, target_path: Path, *, streams: bool):
    """The target as feature making runs it: decodes of up to EXTRACT_BATCH tokens from up to
    EXTRACT_SEQS sequences. streams (self-distillation): --distill-seqs slots, every slot stays in the
    KV cache, each in its own stream (attention reads only its own slot's cells); otherwise a batch
    of conversations is packed into one stream. Weights repacked or not as is faster for batches
    (_native.batch_repack)."""
    from . import _native as nat
    from .draft import TargetModel

    n_seqs = args.distill_seqs if streams else EXTRACT_SEQS
    n_batch = max(EXTRACT_BATCH, args.max_len, n_seqs)
    n_ctx = n_seqs * args.max_len if streams else n_batch
    return TargetModel(target_path, n_ctx=n_ctx, n_batch=n_batch, n_threads=args.threads or 2,
                       n_seq_max=n_seqs, kv_unified=not streams, repack=nat.batch_repack())


def folder_rates(manifest: dict) -> dict:
    """A feature folder's tokens, wall seconds and tokens/s, as the card states them."""
    return {"tokens": manifest["n_tokens"], "seconds": round(manifest["seconds"], 1),
            "tokens_per_s": round(manifest["n_tokens"] / max(manifest["seconds"], 1e-9), 1)}


def split_at_tokens(shards: list[Path], n_tokens: int) -> tuple[list[Path], list[Path], int]:
    """(the first shards that hold n_tokens tokens, the rest, the tokens the first ones hold); a
    shard's size is read only until the first part is complete."""
    from .training.features import read_arrays

    total = 0
    for i, path in enumerate(shards):
        if total >= n_tokens:
            return shards[:i], shards[i:], total
        total += int(read_arrays(path, "offsets")[0][-1])
    return shards, [], total


def first_tokens(shards: list[Path], n_tokens: int) -> list[Path]:
    """The first shards that hold n_tokens tokens: a folder made for more trains on --tokens only."""
    return split_at_tokens(shards, n_tokens)[0]


def shards_after(shards: list[Path], n_tokens: int) -> tuple[list[Path], int]:
    """The shards past the first ones that hold n_tokens tokens, and how many tokens those held:
    a grown folder's new part, for a head that goes on from one trained on its start."""
    _, rest, skipped = split_at_tokens(shards, n_tokens)
    return rest, skipped


def cmd_train(args) -> int:
    """Features from the patched llama.cpp (ShareGPT or self-distilled), then a head in HF layout,
    then its GGUF. Every stage resumes from what an interrupted run left in --out."""
    from .convert import convert
    from .training import train

    out = Path(args.out)
    target_path = Path(args.target)
    if args.distill_seqs < 1:
        raise SystemExit(f"--distill-seqs {args.distill_seqs}: give at least 1 reply per decode")
    cfg = train.TrainConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, p_weight=args.p_weight,
                            noise=args.noise, draft_vocab=args.draft_vocab, seed=args.seed, steps=args.steps,
                            step_decay=args.step_decay, init_from_target=args.init_from_target,
                            intermediate_size=args.intermediate_size, int8=args.int8,
                            init_from_head=args.init_from_head or "", bf16=args.bf16)
    if args.features and len(args.features) > 1:
        if args.self_distill or args.tokens_from or args.user_turn is not None:
            raise SystemExit("several --features folders are only read: make each one alone first")
        feature_dir = ", ".join(args.features)
        shards, made = several_folders([Path(f) for f in args.features])
        if args.tokens:
            shards = first_tokens(shards, args.tokens)
    else:
        feature_dir = Path(args.features[0]) if args.features else out / ("distill" if args.self_distill else "features")
        shards, made = make_features(args, target_path, feature_dir)
    if args.features_only:
        return 0
    if args.skip_tokens:
        shards, made["skipped_tokens"] = shards_after(shards, args.skip_tokens)
        if not shards:
            raise SystemExit(f"{feature_dir}: nothing past its first {args.skip_tokens} tokens to train on")
    head_dir = train.train(target_path, shards, out, cfg, n_threads=args.threads, card_extra={"features": made})
    gguf_path = convert(head_dir, out / "eagle2-f16.gguf", target=target_path, outtype="f16", force=True)
    card = json.loads((head_dir / "training.json").read_text())
    print(f"training: {card['tokens_per_s']} tokens/s", file=sys.stderr)
    print(f"head: {head_dir} (HF layout), draft GGUF: {gguf_path}", file=sys.stderr)
    print(f"held-out: {card['eval']}", file=sys.stderr)
    return 0


def add_train_args(t) -> None:
    t.add_argument("--target", "-m", required=True, help="target model GGUF (llama or qwen2 family)")
    t.add_argument("--out", "-o", required=True, help="work folder: features, resumable checkpoints, head/")
    t.add_argument("--features", nargs="+", metavar="DIR",
                   help="feature folder (default: OUT/features, or OUT/distill with --self-distill); several "
                        "heads can train on one. Several folders: train on all they hold at once (made before)")
    t.add_argument("--tokens", type=int, help=f"tokens of features (prompts and replies) to make and train on "
                   f"(default: {DEFAULT_TOKENS}, or all that a --features folder holds if more)")
    t.add_argument("--self-distill", action="store_true",
                   help="train on the target's own replies to ShareGPT prompts (--distill-seqs per decode)")
    t.add_argument("--distill-seqs", type=int, default=EXTRACT_SEQS,
                   help="replies generated at once, one decode advancing them all (bigger targets gain from "
                        "more: 32-128 on Qwen2.5-Coder-1.5B, README)")
    t.add_argument("--user-turn", type=int,
                   help="with --self-distill: answer each conversation's N-th user message (default: 1, or the "
                        "folder's), its turns before as context, skipping conversations with fewer: new replies "
                        "once the first turns are used up (longer prompts: raise --max-len)")
    t.add_argument("--distill-temp", type=float, default=0.0, help="sampling temperature of those replies (0: greedy)")
    t.add_argument("--features-only", action="store_true", help="stop once the features are made")
    t.add_argument("--tokens-from", nargs="+", metavar="DIR",
                   help="make the features for the sequences of these feature folders (e.g. replies that a "
                        "smaller model with the same tokenizer self-distilled) instead of new text")
    t.add_argument("--first-conversation", type=int, default=0,
                   help="a fresh feature folder starts at this ShareGPT conversation (shuffled order): new "
                        "data past what an earlier head was trained on")
    t.add_argument("--skip-tokens", type=int, default=0,
                   help="train only on the folder's shards past its first N tokens (with --init-from-head: the "
                        "part a folder grew by since that head trained on it; held-out replies come from it too)")
    t.add_argument("--max-len", type=int, default=384, help="tokens per conversation (longer ones are cut)")
    t.add_argument("--epochs", type=int, default=4)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--lr", type=float, default=5e-4)
    t.add_argument("--p-weight", type=float, default=0.1,
                   help="weight of the token loss (soft cross-entropy) next to the feature loss")
    t.add_argument("--noise", type=float, default=0.1, help="U(-noise, noise) on input features")
    t.add_argument("--steps", type=int, default=1,
                   help="chained prediction steps trained (training-time test): >1 also trains steps 2..N "
                        "on the head's own features")
    t.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step s: DECAY^(s-1)")
    t.add_argument("--init-from-target", action="store_true",
                   help="start the head's decoder layer as a copy of the target's last layer")
    t.add_argument("--init-from-head", metavar="DIR",
                   help="start from a trained head (HF folder, e.g. a shipped one): go on training it on "
                        "new data")
    t.add_argument("--intermediate-size", type=int, default=0,
                   help="the head's MLP width (default: the target's); with --init-from-target the head "
                        "keeps the target's strongest MLP channels")
    t.add_argument("--int8", action="store_true",
                   help="store the head's weights as int8 blocks (Q8_0's layout): half the size of float16")
    t.add_argument("--bf16", action="store_true",
                   help="train under bfloat16 autocast (weights and optimizer stay float32): several times "
                        "faster on CPUs with AMX or AVX512-BF16")
    t.add_argument("--draft-vocab", type=int, default=16384,
                   help="most frequent target tokens the cross-entropy (and a restricted lm_head) covers")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("-t", "--threads", type=int, default=None)


def bench_drafts(args, target: Path, work: Path) -> dict[str, Path]:
    """The drafts `bench` compares: -md as given, or each --head (or an untrained head) converted once
    per --draft-vocab size; with several heads the labels name their folders (the first head also
    drafts the fixed-tree and llama-server runs)."""
    from . import heads
    from .random_head import head_for_target

    if args.draft:
        return {"": Path(args.draft)}
    folders = [Path(h) for h in args.head] if args.head else [head_for_target(target, work / "untrained-head")]
    if len({f.name for f in folders}) < len(folders):
        raise SystemExit("bench: the --head folders need distinct names (they label the rows)")
    try:
        sizes = [None if v == "auto" else int(v) for v in args.draft_vocab.split(",") if v] if args.head else [0]
    except ValueError:
        raise SystemExit(f"bench: --draft-vocab takes sizes and 'auto', comma-separated (got {args.draft_vocab})") \
            from None
    drafts = {}
    for folder in folders:
        name = f"-{folder.name}" if len(folders) > 1 else ""
        for n in sizes:
            draft = heads.draft_gguf(folder, target, n)
            drafts[name + draft_vocab_label(draft)] = draft
    return drafts


def draft_vocab_label(draft: Path) -> str:
    """-vocabN for a draft whose lm_head covers N tokens, as converted (d2t), else -fullvocab. Read by
    the library (0.4 s for a 1.5B draft), not gguf-py, which parses the copied tokenizer (8 s)."""
    from . import _native as nat

    model = nat.load_model(draft, repack=False)
    try:
        ids = nat.draft_vocab(model)
    finally:
        nat.llama_cpp.llama_model_free(model)
    return "-fullvocab" if ids is None else f"-vocab{len(ids)}"


def cmd_bench(args) -> int:
    from .bench import run_bench

    target, out_dir = Path(args.target), Path(args.out)
    drafts = bench_drafts(args, target, out_dir)
    out = run_bench(target, drafts, n_prompts=args.n_prompts, max_tokens=args.n_predict,
                    out_dir=out_dir, n_threads=args.threads, n_ctx=args.ctx_size,
                    fixed_tree=tuple(int(v) for v in args.fixed_tree.split(",")),
                    draft_model=Path(args.draft_model) if args.draft_model else None,
                    with_server=not args.no_server, with_fixed=not args.no_fixed, progress=not args.no_progress,
                    flash_attn=args.flash_attn)
    print(out["markdown"])
    print(f"written: {args.out}/bench.md, bench.json, bench.png", file=sys.stderr)
    return 0


def add_bench_args(b) -> None:
    b.add_argument("--target", "-m", required=True, help="target model GGUF")
    drafts = b.add_mutually_exclusive_group(required=True)
    drafts.add_argument("--draft", "-md", help="eagle2 draft GGUF")
    drafts.add_argument("--head", action="append",
                        help="an EAGLE head folder (HF layout), converted for the target per --draft-vocab; "
                             "repeat it to compare heads in one run")
    drafts.add_argument("--untrained", action="store_true",
                        help="a random head of the target's shape (whole vocabulary): what drafting costs when "
                             "nothing gets accepted")
    b.add_argument("--draft-vocab", default="auto",
                   help="with --head: comma list of draft vocabulary sizes, one auto-tree run each (0: the whole "
                        "one; auto: the converter's default for the target)")
    b.add_argument("--draft-model", help="a small model of the same vocabulary for upstream's draft-model "
                                         "speculation in llama-server (e.g. the 0.5B for the 1.5B)")
    b.add_argument("-N", "--n-prompts", type=int, default=8, help="MT-bench first turns, round-robin by category")
    b.add_argument("-n", "--n-predict", type=int, default=128)
    b.add_argument("-c", "--ctx-size", type=int, default=2048)
    b.add_argument("-t", "--threads", type=int, default=2)
    b.add_argument("--fixed-tree", default="6,4,2", help="TOTAL,DEPTH,TOP_K of the fixed-tree EAGLE-2 run")
    b.add_argument("--no-fixed", action="store_true", help="skip the fixed-tree run")
    b.add_argument("--flash-attn", "-fa", choices=("off", "on", "auto"), default="auto",
                   help="flash attention for every method, Python and llama-server alike (default: auto, "
                        "llama.cpp's and EagleLlama's default)")
    b.add_argument("--no-server", action="store_true", help="skip the llama-server methods")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("-o", "--out", default="bench-out")


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
                   help="draft tree: auto (measured on this machine; drafts only when it pays) or TOTAL,DEPTH,TOP_K "
                        "(DEPTH: tree levels, TOP_K=1: a chain)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="eagle-llamacpp")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("convert", help="convert an EAGLE-1/2 head to GGUF (see convert_eagle.py --help)",
                   add_help=False)
    add_generate_args(sub.add_parser("generate", help="generate text with EAGLE-2 speculative decoding"))
    add_train_args(sub.add_parser("train", help="train an EAGLE-1/2 head for a GGUF target"))
    add_bench_args(sub.add_parser("bench", help="MT-bench: EAGLE-2 vs plain decoding and upstream's speculation"))
    d = sub.add_parser("demo", help="EAGLE-2 with the shipped head on Qwen2.5-Coder-0.5B, next to plain decoding")
    d.add_argument("--draft", help="eagle2 draft GGUF (default: the shipped head, converted once)")
    d.add_argument("-p", "--prompt", default="Write a Python function that checks whether a string is a palindrome.")
    d.add_argument("-n", "--n-predict", type=int, default=128)
    d.add_argument("-t", "--threads", type=int, default=2)
    d.add_argument("--tree", type=parse_tree, default="auto")
    d.add_argument("--draft-vocab", type=int, default=None,
                   help="draft vocabulary the shipped head is converted with (0: the whole vocabulary; "
                        "default: convert_eagle.py's)")
    args, rest = p.parse_known_args(argv)
    if args.cmd == "convert":
        from .convert import main as convert_main
        return convert_main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    from ._native import EagleError
    try:
        return {"generate": cmd_generate, "train": cmd_train, "bench": cmd_bench, "demo": cmd_demo}[args.cmd](args)
    except EagleError as e:
        print(f"eagle-llamacpp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
