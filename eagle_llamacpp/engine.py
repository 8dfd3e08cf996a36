"""The engine loop: propose a draft tree, score it with one target decode, accept, repeat."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import _native as nat
from .accept import greedy_accept, sample_accept, target_distribution
from .autotune import AutoPolicy, cached_verify_ms
from .completion import CompletionMixin
from .draft import EagleDraft, TargetModel
from .proposer import EagleProposer, FixedPolicy, Timer, TreeShape
from .scorer import TreeScorer
from .stats import SpecStats
from .tree import DraftTree

# the paper's GPU defaults (depth counts levels: its code's depth 5), and what fits a few CPU cores
# (../shared/reference/cpu_costs.md). On the CPU backend a decode of up to 7 tokens (flash attention
# on, llama.cpp's default) gives every token the logits of one-token decodes to the bit; from 8 tokens
# ggml's tiled flash attention rounds differently (up to 0.2 log-prob on Qwen2.5-0.5B Q4_K_M), and
# bigger trees do not pay here anyway
GPU_TREE = TreeShape(total_tokens=60, depth=6, top_k=10)
CPU_TREE = TreeShape(total_tokens=7, depth=5, top_k=4)


@dataclass
class Sampling:
    """llama-cpp-python's sampling knobs and defaults; temperature 0 is greedy."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class _TargetArgmax:
    """target_argmax[i] for greedy_accept, read only for the nodes the acceptor visits."""

    def __init__(self, scorer: TreeScorer):
        self.scorer = scorer

    def __getitem__(self, i: int) -> int:
        return self.scorer.argmax(i)


class _TargetProbs:
    """target_probs[i] for sample_accept, warped only for the nodes the acceptor visits."""

    def __init__(self, scorer: TreeScorer, sampling: Sampling):
        self.scorer, self.sampling, self.cache = scorer, sampling, {}

    def __getitem__(self, i: int) -> np.ndarray:
        if i not in self.cache:
            s = self.sampling
            self.cache[i] = target_distribution(self.scorer.logits(i), s.temperature, s.top_k, s.top_p, s.min_p)
        return self.cache[i]


class EagleLlama(CompletionMixin):
    """EAGLE-2 speculative decoding of a GGUF target with an `eagle2` GGUF draft head.

    tree: "auto" (measure this machine; per round, draft only when it pays and pick the size), a
    TreeShape, or a tuple (total_tokens, depth, top_k); top_k=1 drafts a chain. A draft converted
    with a draft vocabulary computes its logits over those target tokens only; verification keeps
    the full vocabulary, so the output does not change, only the speed.

    flash_attn: None keeps llama.cpp's "auto" (on, on the CPU). Off decodes faster on the CPU here
    (benchmarks/flash_attn.py), and with patch 0006 a chain-shaped verify is then still exact, but a
    node off the first branch sums its attention over other groups of cells than one-token decoding
    would, so a near-tie may round the other way (README, Known limits); True/False force it.

    share_target: another engine on the same target file: this one decodes with that engine's loaded
    target (its context and settings) instead of loading the weights again, e.g. to compare heads or
    tree shapes on a big target. The engines take turns (each generate() starts from an emptied
    cache), and the one that loaded the target is closed last: the drafts borrow its context.
    """

    def __init__(self, target_gguf: str | os.PathLike, draft_gguf: str | os.PathLike, *, n_ctx: int = 2048,
                 n_threads: int | None = None, n_gpu_layers: int = 0, flash_attn: bool | None = None,
                 tree: str | TreeShape | tuple = "auto", n_batch: int = 512, share_target: EagleLlama | None = None):
        n_threads = n_threads or os.cpu_count() or 2
        self._owns_target = share_target is None
        if share_target is None:
            self.target = TargetModel(target_gguf, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                      n_gpu_layers=n_gpu_layers, flash_attn=flash_attn)
        elif Path(target_gguf).resolve() != share_target.target.path.resolve():
            raise ValueError(f"share_target decodes {share_target.target.path}, not {target_gguf}")
        else:
            self.target = share_target.target
        self.n_ctx = nat.llama_cpp.llama_n_ctx(self.target.ctx)  # llama.cpp rounds n_ctx up
        max_shape = GPU_TREE if n_gpu_layers != 0 else CPU_TREE
        self.shape = max_shape if tree == "auto" else tree if isinstance(tree, TreeShape) else TreeShape(*tree)
        try:
            self.draft = EagleDraft(draft_gguf, self.target, n_ctx=self.n_ctx + self.shape.depth + 1, n_batch=n_batch,
                                    n_threads=n_threads, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn)
        except nat.EagleError:
            if self._owns_target:
                self.target.close()  # a draft for another target: free the target now, not at GC
            raise
        self.model_path = str(Path(target_gguf))
        self.n_batch = nat.llama_cpp.llama_n_batch(self.target.ctx)  # llama.cpp caps it at n_ctx
        self.proposer = EagleProposer(self.draft)
        self.scorer = TreeScorer(self.target)
        if tree == "auto":
            self.policy = AutoPolicy(cached_verify_ms(self.target, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                                                      flash_attn=flash_attn, max_tokens=self.shape.total_tokens))
        else:
            self.policy = FixedPolicy(self.shape)
        self.vocab = nat.llama_cpp.llama_model_get_vocab(self.target.model)
        # diagnostics: called after each verify with the round's DraftTree and accepted path (node
        # indices, the root first), e.g. benchmarks/node_calibration.py
        self.on_round = None

    def close(self) -> None:
        self.draft.close()
        if self._owns_target:
            self.target.close()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.target.tokenize(text, add_special)

    def is_eog(self, token: int) -> bool:
        return bool(nat.llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # --- the loop ---------------------------------------------------------------------------

    def generate(self, tokens: list[int], max_tokens: int = 256, sampling: Sampling | None = None,
                 stats: SpecStats | None = None) -> Iterator[int]:
        """Yields generated token ids (stops after an end-of-generation token, max_tokens, or a full
        context). stats, if given, is filled as the generation goes."""
        sampling = sampling or Sampling()
        stats = stats if stats is not None else SpecStats()
        tokens = [int(t) for t in tokens]
        self._check_prompt(tokens)
        rng = np.random.default_rng(sampling.seed)
        with Timer() as t_prompt:
            root, feats = self._prefill(tokens, sampling, rng)
            self.proposer.commit(tokens[1:] + [root], feats)
            self.proposer.catch_up()
        stats.prompt_s += t_prompt.total
        self.policy.begin()
        n_past, n_out = len(tokens), 1
        self.last_finish_reason = "length"
        yield root
        while n_out < max_tokens and not self.is_eog(root):
            room = self.n_ctx - n_past
            if room < 1:
                return  # the context is full: finish_reason "length"
            with Timer() as t_draft:
                tree = self.proposer.propose(root, self.shape, self.policy, max_nodes=room - 1)
            with Timer() as t_verify:
                self.scorer.score(tree, n_past)
                if sampling.greedy:
                    path, bonus = greedy_accept(tree, _TargetArgmax(self.scorer))
                else:
                    path, bonus = sample_accept(tree, _TargetProbs(self.scorer, sampling), rng)
                self.scorer.commit(tree, path)
                feats = self.scorer.features(path)
            if self.on_round is not None:
                self.on_round(tree, path)
            accepted = [int(t) for t in tree.tokens[path[1:]]]
            stats.add_round(int(tree.depths.max()), tree.n - 1, len(accepted), self.proposer.last_decodes,
                            t_draft.total, t_verify.total)
            self.policy.observe(tree.n - 1, len(accepted), t_draft.total * 1e3, self.proposer.last_decodes,
                                t_verify.total * 1e3)
            # queued for the next draft: no decode here
            self.proposer.commit(accepted + [bonus], feats)
            n_past += len(path)
            root = bonus
            for tok in accepted + [bonus]:
                yield tok
                n_out += 1
                if n_out >= max_tokens or self.is_eog(tok):
                    self.last_finish_reason = "stop" if self.is_eog(tok) else "length"
                    return
        if self.is_eog(root):
            self.last_finish_reason = "stop"

    def _check_prompt(self, tokens: list[int]) -> None:
        if not tokens:
            raise nat.EagleError("the prompt is empty: give at least one token")
        if len(tokens) >= self.n_ctx:
            raise nat.EagleError(f"the prompt has {len(tokens)} tokens, the context holds {self.n_ctx}: "
                                 "shorten the prompt or raise n_ctx")
        bad = [t for t in tokens if not 0 <= t < self.target.n_vocab]
        if bad:
            raise nat.EagleError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.n_vocab - 1})")

    def _prefill(self, tokens: list[int], sampling: Sampling, rng) -> tuple[int, np.ndarray]:
        """Decodes the prompt; returns the first generated token and the prompt's target features."""
        nat.clear_memory(self.target.ctx)
        self.proposer.reset()
        feats = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            outputs = np.zeros(len(chunk), np.int8)
            outputs[-1] = 1
            self.target.decode(chunk, start + np.arange(len(chunk)), outputs=outputs)
            feats.append(nat.feature_rows(self.target.ctx, np.arange(len(chunk)), self.target.n_embd))
        last = len(tokens) - 1 - (len(tokens) - 1) // self.n_batch * self.n_batch
        if sampling.greedy:
            first = nat.argmax_ith(self.target.ctx, last, self.target.n_vocab)
        else:
            p = target_distribution(self.target.logits(last), sampling.temperature, sampling.top_k,
                                    sampling.top_p, sampling.min_p)
            first = int(rng.choice(len(p), p=p))
        return first, np.concatenate(feats)
