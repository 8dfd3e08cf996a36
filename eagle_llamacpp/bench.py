"""`eagle-llamacpp bench`: MT-bench first turns, greedy, every method on every prompt in one run
(interleaved, so machine noise hits all alike): plain decoding, EAGLE-2 (auto trees per draft
vocabulary, a fixed tree), and upstream's alternatives through the patched llama-server (no
speculation, EAGLE-2 of patch 0005, a draft model, n-gram lookup). For each method it reports where
a round's time goes (draft, verify, the rest), and for the machine the ceiling an oracle draft would
reach at each tree size. Writes a markdown table, JSON and a PNG plot.
"""

from __future__ import annotations

import json
import platform
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import _native as nat
from .data import Question, mtbench_questions
from .stats import SpecStats


@dataclass
class Result:
    method: str
    question_id: int
    category: str
    n_tokens: int      # generated, up to and including the first end-of-generation token
    gen_s: float       # after the prompt
    decodes: int       # target decodes after the prompt (speculative rounds; = n_tokens - 1 for plain)
    drafted: int = 0
    accepted: int = 0
    tokens: list[int] = field(default_factory=list, repr=False)
    draft_s: float | None = None   # of gen_s: in the draft (None where not measured: the servers)
    verify_s: float | None = None  # of gen_s: in the target's verify decodes
    drafting_rounds: int | None = None


def pick_questions(n: int, questions: list[Question] | None = None) -> list[Question]:
    """n questions, round-robin over the categories, so that every category is covered early."""
    by_cat = defaultdict(list)
    for q in questions or mtbench_questions():
        by_cat[q.category].append(q)
    picked, i = [], 0
    while len(picked) < n and any(i < len(v) for v in by_cat.values()):
        picked += [v[i] for v in by_cat.values() if i < len(v)][:n - len(picked)]
        i += 1
    return picked


class PythonMethods:
    """Plain decoding and EAGLE-2 variants, all in this process on the patched libllama."""

    def __init__(self, target: Path, n_threads: int, n_ctx: int, eagle: dict[str, tuple[Path, dict]]):
        """eagle: method name -> (draft GGUF, EagleLlama keywords)."""
        from .engine import EagleLlama

        # one copy of the target for all: ggml copies CPU weights it repacks (and F16 on AMX CPUs)
        # into process memory, 3 GB for the 1.5B in F16
        self.engines: dict[str, EagleLlama] = {}
        first = None
        for name, (draft, kw) in eagle.items():
            self.engines[name] = EagleLlama(target, draft, n_ctx=n_ctx, n_threads=n_threads, share_target=first, **kw)
            first = first or self.engines[name]
        self.plain_target = first.target

    def names(self) -> list[str]:
        return ["plain", *self.engines]

    def run(self, name: str, tokens: list[int], max_tokens: int, q: Question) -> Result:
        if name == "plain":
            return self._plain(tokens, max_tokens, q)
        llm, stats = self.engines[name], SpecStats()
        t0 = time.perf_counter()
        out = list(llm.generate(tokens, max_tokens, _greedy(), stats))
        wall = time.perf_counter() - t0
        return Result(name, q.question_id, q.category, len(out), wall - stats.prompt_s, stats.rounds,
                      stats.drafted, stats.accepted, out, stats.draft_s, stats.verify_s, stats.drafting_rounds)

    def _plain(self, tokens: list[int], max_tokens: int, q: Question) -> Result:
        out, gen_s = plain_greedy(next(iter(self.engines.values())), tokens, max_tokens)
        return Result("plain", q.question_id, q.category, len(out), gen_s, len(out) - 1, tokens=out,
                      draft_s=0.0, verify_s=gen_s, drafting_rounds=0)

    def close(self) -> None:
        for llm in reversed(self.engines.values()):  # the first, which loaded the target, last
            llm.close()


def prefill(target, tokens: list[int]) -> int:
    """Decodes tokens into the target's emptied memory, n_batch at a time, with logits for the last
    one only; returns that token's batch index."""
    nat.clear_memory(target.ctx)
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    for start in range(0, len(tokens), n_batch):
        chunk = tokens[start:start + n_batch]
        outputs = np.zeros(len(chunk), np.int8)
        outputs[-1] = 1
        target.decode(chunk, start + np.arange(len(chunk)), outputs=outputs)
    return (len(tokens) - 1) % n_batch


def top2_gap(target, tokens: list[int]) -> float:
    """Gap between the target's two best next-token logits after `tokens`."""
    top = np.sort(target.logits(prefill(target, tokens)))[-2:]
    return float(top[1] - top[0])


def plain_greedy(llm, tokens: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One token per target decode, as llama.cpp decodes without speculation, on llm's target.
    Returns the tokens and the seconds after the prompt."""
    t = llm.target
    last = prefill(t, tokens)
    t0 = time.perf_counter()
    out = [nat.argmax_ith(t.ctx, last, t.n_vocab)]
    n_past = len(tokens)
    while len(out) < max_tokens and not llm.is_eog(out[-1]) and n_past < llm.n_ctx:
        t.decode([out[-1]], [n_past], outputs=np.ones(1, np.int8))
        n_past += 1
        out.append(nat.argmax_ith(t.ctx, 0, t.n_vocab))
    return out, time.perf_counter() - t0


def _greedy():
    from .engine import Sampling

    return Sampling(temperature=0.0)


class ServerMethods:
    """Upstream llama.cpp's decoding through the patched llama-server, one server per method."""

    def __init__(self, target: Path, servers: dict[str, list[str]], n_threads: int, n_ctx: int, log_dir: Path,
                 bin_dirs: dict[str, Path] | None = None):
        """bin_dirs: method name -> another build's bin folder to run it from (LlamaServer's bin_dir)."""
        from .llama_server import LlamaServer

        self.servers = {}
        try:
            for name, args in servers.items():
                self.servers[name] = LlamaServer(target, args, n_ctx=n_ctx, n_threads=n_threads,
                                                 log_path=log_dir / f"{name}.log",
                                                 bin_dir=(bin_dirs or {}).get(name))
        except Exception:
            self.close()
            raise

    def names(self) -> list[str]:
        return list(self.servers)

    def run(self, name: str, tokens: list[int], max_tokens: int, q: Question) -> Result:
        r = self.servers[name].complete(tokens, max_tokens)
        timings = r.get("timings", {})
        n = int(timings.get("predicted_n", len(r.get("tokens", []))))
        accepted = int(timings.get("draft_n_accepted", 0))
        # every speculative step emits its accepted draft tokens plus one
        return Result(name, q.question_id, q.category, n, float(timings.get("predicted_ms", 0.0)) / 1e3,
                      max(n - 1 - accepted, 0), int(timings.get("draft_n", 0)), accepted, list(r.get("tokens", [])))

    def close(self) -> None:
        for s in self.servers.values():
            s.close()


def summarize(results: list[Result], methods: list[str]) -> dict:
    """Aggregate tokens/s (sum of tokens / sum of time), ratios and acceptance per method and category."""
    plain = {r.question_id: r for r in results if r.method == "plain"}
    server_plain = {r.question_id: r for r in results if r.method == "server-plain"}

    def agg(rs: list[Result]) -> dict:
        n, s = sum(r.n_tokens for r in rs), sum(r.gen_s for r in rs)
        decodes = sum(r.decodes for r in rs)
        drafted, accepted = sum(r.drafted for r in rs), sum(r.accepted for r in rs)
        out = {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s, 3) if s else 0.0,
               "acceptance_length": round((n - len(rs)) / decodes, 3) if decodes else None,
               "draft_acceptance_rate": round(accepted / drafted, 3) if drafted else None,
               "ms_per_round": round(s * 1e3 / decodes, 3) if decodes else None}
        if decodes and all(r.draft_s is not None for r in rs):
            draft, verify = sum(r.draft_s for r in rs), sum(r.verify_s for r in rs)
            out.update(draft_ms_per_round=round(draft * 1e3 / decodes, 3),
                       verify_ms_per_round=round(verify * 1e3 / decodes, 3),
                       other_ms_per_round=round((s - draft - verify) * 1e3 / decodes, 3),
                       drafting_rounds=sum(r.drafting_rounds for r in rs))
        return out

    out = {}
    for m in methods:
        rs = [r for r in results if r.method == m]
        if not rs:
            continue
        cats = sorted({r.category for r in rs})
        row = agg(rs)
        row["same_tokens_as_plain"] = sum(r.tokens == plain[r.question_id].tokens for r in rs if r.question_id in plain)
        row["same_tokens_as_server_plain"] = sum(r.tokens == server_plain[r.question_id].tokens
                                                 for r in rs if r.question_id in server_plain)
        row["by_category"] = {c: agg([r for r in rs if r.category == c]) for c in cats}
        out[m] = row
    plain_ms = out.get("plain", {}).get("ms_per_round")
    for m, row in out.items():
        if plain_ms and row.get("verify_ms_per_round") is not None:
            row["verify_over_plain_token"] = round(row["verify_ms_per_round"] / plain_ms, 3)
        for base in ("plain", "server-plain"):
            if base in out and out[base]["tokens_per_s"]:
                row[f"speedup_vs_{base}"] = round(row["tokens_per_s"] / out[base]["tokens_per_s"], 3)
                for c, crow in row["by_category"].items():
                    b = out[base]["by_category"].get(c, {}).get("tokens_per_s")
                    crow[f"speedup_vs_{base}"] = round(crow["tokens_per_s"] / b, 3) if b else None
    return out


def markdown(summary: dict, n_prompts: int, ceiling: dict | None = None) -> str:
    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    lines = ["| method | tokens/s | x plain | x server-plain | acceptance length | draft accepted | "
             f"same tokens as plain (of {n_prompts}) |", "|---|---|---|---|---|---|---|"]
    for m, r in summary.items():
        lines.append(f"| {m} | {r['tokens_per_s']:.2f} | {fmt(r.get('speedup_vs_plain'))} | "
                     f"{fmt(r.get('speedup_vs_server-plain'))} | {fmt(r['acceptance_length'])} | "
                     f"{fmt(r['draft_acceptance_rate'], '.0%')} | {r['same_tokens_as_plain']} |")
    lines += ["", "Where a round's time goes (a round: one target decode; plain decoding: one token):", "",
              "| method | ms per round | draft ms | verify ms | other ms | verify / plain token | tokens per round "
              "| rounds that drafted |", "|---|---|---|---|---|---|---|---|"]
    for m, r in summary.items():
        n_rounds = round(r["tokens"] / r["acceptance_length"]) if r.get("acceptance_length") else None
        drafting = r.get("drafting_rounds")
        lines.append(f"| {m} | {fmt(r.get('ms_per_round'))} | {fmt(r.get('draft_ms_per_round'))} | "
                     f"{fmt(r.get('verify_ms_per_round'))} | {fmt(r.get('other_ms_per_round'))} | "
                     f"{fmt(r.get('verify_over_plain_token'))} | {fmt(r.get('acceptance_length'))} | "
                     f"{'-' if drafting is None or not n_rounds else f'{drafting / n_rounds:.0%}'} |")
    if ceiling:
        sizes = list(ceiling["verify_ms"])
        lines += ["", "Ceiling on this machine: an oracle draft (every drafted token accepted, zero draft cost) "
                  "verifying N tokens per round, from the measured verify cost:", "",
                  "| N verified | " + " | ".join(map(str, sizes)) + " |", "|---" * (len(sizes) + 1) + "|",
                  "| verify ms | " + " | ".join(f"{ceiling['verify_ms'][n]:.1f}" for n in sizes) + " |",
                  "| cost / one token | " + " | ".join(f"{ceiling['cost'][n]:.2f}" for n in sizes) + " |",
                  "| ceiling x plain | " + " | ".join(f"{ceiling['speedup'][n]:.2f}" for n in sizes) + " |"]
    cats = sorted({c for r in summary.values() for c in r["by_category"]})
    lines += ["", "Speedup vs plain per MT-bench category:", "",
              "| method | " + " | ".join(cats) + " |", "|---" * (len(cats) + 1) + "|"]
    for m, r in summary.items():
        vals = [r["by_category"].get(c, {}).get("speedup_vs_plain") for c in cats]
        lines.append(f"| {m} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) + " |")
    return "\n".join(lines) + "\n"


def oracle_ceiling(verify_ms: dict[int, float]) -> dict:
    """Speedup of an oracle draft at each verified size N: N tokens per round for the cost of verifying N."""
    one = verify_ms[1]
    return {"verify_ms": {n: round(ms, 3) for n, ms in verify_ms.items()},
            "cost": {n: round(ms / one, 3) for n, ms in verify_ms.items()},
            "speedup": {n: round(n * one / ms, 3) for n, ms in verify_ms.items()}}


def plot(summary: dict, path: Path, title: str) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    cats = ["all"] + sorted({c for r in summary.values() for c in r["by_category"]})
    methods = list(summary)
    fig, ax = plt.subplots(figsize=(12, 4.5))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [summary[m]["tokens_per_s"]] + [summary[m]["by_category"].get(c, {}).get("tokens_per_s", 0)
                                                for c in cats[1:]]
        ax.bar(np.arange(len(cats)) + i * width, vals, width, label=m)
    ax.set_xticks(np.arange(len(cats)) + 0.4 - width / 2, cats)
    ax.set_ylabel("generated tokens/s (greedy)")
    ax.set_title(title)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_bench(target: Path, drafts: dict[str, Path], *, n_prompts: int, max_tokens: int, out_dir: Path,
              n_threads: int = 2, n_ctx: int = 2048, fixed_tree=(6, 4, 2), draft_model: Path | None = None,
              with_server: bool = True, with_fixed: bool = True, progress: bool = True,
              flash_attn: str = "auto") -> dict:
    """drafts: label -> eagle2 draft GGUF (e.g. one per draft vocabulary); each gets an auto-tree run, the
    first also the fixed tree and llama-server's draft-eagle2. flash_attn ("on", "off", "auto") applies
    to every method alike, in Python and in llama-server."""
    from tqdm import tqdm

    from .autotune import measure_verify_ms
    from .chat import ChatRenderer

    out_dir.mkdir(parents=True, exist_ok=True)
    first = next(iter(drafts.values()))
    fa = {"on": True, "off": False, "auto": None}[flash_attn]
    eagle = {f"eagle2-auto{label}": (path, {"tree": "auto"}) for label, path in drafts.items()}
    if with_fixed:
        eagle["eagle2-fixed-" + "-".join(map(str, fixed_tree))] = (first, {"tree": tuple(fixed_tree)})
    eagle = {name: (path, {**kw, "flash_attn": fa}) for name, (path, kw) in eagle.items()}
    servers = {}
    if with_server:
        servers = {"server-plain": [], "server-ngram-simple": ["--spec-type", "ngram-simple"],
                   "server-ngram-mod": ["--spec-type", "ngram-mod"]}
        # patch 0005: the same head, drafted and verified in C++, drafting only when it pays
        servers["server-eagle2"] = ["-md", str(first), "--spec-type", "draft-eagle2", "--spec-draft-n-max", "6",
                                    "--spec-eagle2-depth", "5", "--spec-eagle2-top-k", "4"]
        if draft_model:
            # -md alone loads the model but speculates with nothing: the type must be named
            servers["server-draft-model"] = ["-md", str(draft_model), "-td", str(n_threads),
                                             "--spec-type", "draft-simple"]
        servers = {name: ["-fa", flash_attn, *args] for name, args in servers.items()}
    questions = pick_questions(n_prompts)
    py = PythonMethods(target, n_threads, n_ctx, eagle)
    srv = None
    try:
        srv = ServerMethods(target, servers, n_threads, n_ctx, out_dir) if servers else None
        renderer = ChatRenderer(py.plain_target)
        prompts = [renderer.prompt_tokens([{"role": "user", "content": q.turns[0]}]) for q in questions]
        runners = [(name, py) for name in py.names()] + [(name, srv) for name in (srv.names() if srv else [])]
        # warm-up: graph allocation, the auto tree's latency table, the servers' first request
        for name, runner in runners:
            runner.run(name, prompts[0][:32], 8, questions[0])
        results = []
        bar = tqdm(total=len(questions) * len(runners), desc="bench", disable=not progress)
        for i, (q, toks) in enumerate(zip(questions, prompts)):
            order = runners[i % len(runners):] + runners[:i % len(runners)]  # rotate who goes first
            for name, runner in order:
                results.append(runner.run(name, toks, max_tokens, q))
                bar.update(1)
        bar.close()
        ceiling = oracle_ceiling(measure_verify_ms(py.plain_target, sizes=(1, 2, 3, 4, 5, 6, 7, 8)))
    finally:
        py.close()
        if srv:
            srv.close()
    methods = [name for name, _ in runners]
    summary = summarize(results, methods)
    report = {"target": target.name, "drafts": {k: v.name for k, v in drafts.items()},
              "draft_model": draft_model.name if draft_model else None,
              "n_prompts": len(questions), "max_tokens": max_tokens, "n_threads": n_threads, "flash_attn": flash_attn,
              "machine": f"{platform.machine()}, {_cpu_name()}, {__import__('os').cpu_count()} cores",
              "ceiling": ceiling, "summary": summary, "results": [asdict(r) for r in results]}
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    md = markdown(summary, len(questions), ceiling)
    (out_dir / "bench.md").write_text(md)
    plot(summary, out_dir / "bench.png", f"{target.name}, MT-bench x{len(questions)}, {max_tokens} tokens, "
                                         f"{n_threads} threads")
    return {"markdown": md, "report": report}


def _cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()
