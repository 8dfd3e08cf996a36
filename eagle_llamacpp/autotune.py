"""tree="auto": draft only when it pays, and verify the tree size that adds the most to the tokens per ms.

The verify latency of each tree size (one token included: plain decoding) is measured once per model
and machine and cached. Each round, EAGLE-2's observation that a node's cumulative draft probability
predicts its acceptance gives the expected accepted tokens of the best N candidates, scaled by how
well that prediction has matched the acceptance observed so far, for the first drafted token and
for deeper ones apart: a head drafts deeper levels from its own features, and oversells them more
(the 0.5B's head on MT-bench: depth 1 accepted at 0.88 of its probability, depths 2 and 3 at 0.70
and 0.61). The size chosen maximizes expected tokens minus the run's recent tokens per ms times the
round's time: a node is worth verifying when its expected tokens per extra ms beat what the rounds
already achieve (the ratio of sums over rounds is what a run's speed is; the best ratio within each
round alone passed up nodes that would have raised it), and never below plain decoding's rate, which
a round's time buys without a draft. The draft itself is skipped for a while
(then caught up in one batched decode) when recent drafting rounds are predicted, that way, to lose
time against plain decoding.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time

import numpy as np

from . import _native as nat
from .models import cache_dir
from .tree import TreeBuilder

SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32, 48, 64)  # verified tokens, root included
MAX_SKIP = 16  # rounds without a draft between two probes, at most (a losing probe costs ~1/4 of a round;
               # probes are what the calibration learns from while drafting is off)
DECAY = 0.95   # per drafting round, of the accepted / predicted sums (~20 rounds of memory)
N_CLASSES = 2  # calibrated apart: drafted depth 1, and depths 2 and beyond
GAIN_WEIGHT = 0.25  # of the newest drafting round in the running predicted gain (~4 rounds of memory)
RATE_DECAY = 0.98   # per round, of the emitted tokens and ms sums whose ratio prices a round's time (~50 rounds)
RATE_PRIOR = 4.0    # rounds of plain decoding the rate starts from


def _machine_key(target, n_threads: int, n_gpu_layers: int, flash_attn: bool | None) -> str:
    st = os.stat(target.path)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    raw = (f"{target.path.name}|{st.st_size}|{cpu}|{os.cpu_count()}|{n_threads}|{n_gpu_layers}|{flash_attn}|"
           f"{nat.library_stamp()}|{nat.use_extra_bufts()}")
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def measure_verify_ms(target, sizes=SIZES, reps: int = 5) -> dict[int, float]:
    """Median time of one tree verify per size (a random chain-shaped tree; shape barely matters,
    see benchmarks/tree_verify.py), after a short prefix. The sizes take turns within each repetition,
    so that a change of machine load hits them all alike, and the curve is made non-decreasing (a
    bigger verify never costs less; a smaller one that measured dearer met noise). Leaves the
    target's memory empty."""
    rng = np.random.default_rng(0)
    nat.clear_memory(target.ctx)
    prefix = rng.integers(0, target.n_vocab, 32)
    target.decode(prefix, np.arange(len(prefix)), outputs=np.zeros(len(prefix), np.int8))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 1):  # the first round allocates the graph of each size
        for n in sizes:
            tokens = rng.integers(0, target.n_vocab, n)
            t0 = time.perf_counter()
            target.decode(tokens, len(prefix) + np.arange(n), tree=(np.arange(n), np.arange(n) - 1))
            if rep:
                times[n].append(time.perf_counter() - t0)
            nat.tree_commit(target.ctx, [])
    nat.clear_memory(target.ctx)
    medians = [float(np.median(times[n]) * 1e3) for n in sizes]
    monotone = np.minimum.accumulate(medians[::-1])[::-1]  # cost[n] = min over sizes >= n
    return {n: float(ms) for n, ms in zip(sizes, monotone)}


def cached_verify_ms(target, *, n_threads: int, n_gpu_layers: int, flash_attn: bool | None,
                     max_tokens: int) -> dict[int, float]:
    """measure_verify_ms for sizes up to max_tokens, cached per target file, machine, attention kernel
    and library build."""
    sizes = [n for n in SIZES if n <= max_tokens]
    path = cache_dir() / "autotune" / f"v2-{_machine_key(target, n_threads, n_gpu_layers, flash_attn)}.json"
    cached = json.loads(path.read_text()) if path.is_file() else {}
    if all(str(n) in cached for n in sizes):
        return {n: cached[str(n)] for n in sizes}
    measured = measure_verify_ms(target, sizes)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**cached, **{str(k): v for k, v in measured.items()}}))
    return measured


class AutoPolicy:
    """The proposer's policy for tree="auto" (see proposer.FixedPolicy for the interface)."""

    def __init__(self, verify_ms: dict[int, float]):
        if 1 not in verify_ms:
            raise ValueError("verify_ms needs the cost of one token (plain decoding)")
        self.verify_ms = dict(sorted(verify_ms.items()))
        # accepted / predicted tokens of drafting rounds per depth class, as decayed sums (a ratio of
        # sums is steadier than an average of per-round ratios, which are 0 or large); the prior reads 1
        self.accepted_sum = np.ones(N_CLASSES)
        self.predicted_sum = np.ones(N_CLASSES)
        self.decode_ms = 0.0    # one draft decode, running average
        self.gain_ms = 0.0      # predicted time recent drafting rounds saved against plain decoding, averaged
        self.backoff = 0        # rounds to skip after the next losing probe
        self.skip = 0           # rounds left without a draft
        self.caught_up = True   # no skipped round since the last draft: its catch-up decode is the usual size
        self.probe = True       # the next draft verifies at least one node, whatever the calibration says
        # accepted tokens per depth class the last choose() predicted, before calibration
        self.last_predicted = np.zeros(N_CLASSES)
        # tokens emitted and ms spent (draft and verify) by recent rounds, decayed sums
        self.tokens_sum = RATE_PRIOR
        self.ms_sum = RATE_PRIOR * self.verify_ms[1]

    @property
    def rate(self) -> float:
        """Tokens per ms of recent rounds: what a ms of a round is worth in tokens. Never less than
        plain decoding's one token per verify of one: that is what the ms would buy without a draft,
        and a run that falls behind it must not take its own low rate as leave to verify more."""
        return max(self.tokens_sum / self.ms_sum, 1.0 / self.verify_ms[1])

    @property
    def calibration(self) -> np.ndarray:
        """Observed / predicted accepted tokens per depth class, floored so that a bad stretch does
        not switch speculation off for good."""
        return np.clip(self.accepted_sum / self.predicted_sum, 0.05, 4.0)

    def _update_verify_cost(self, n_tokens: int, ms: float) -> None:
        """Running average per measured size, kept non-decreasing in the size."""
        if n_tokens not in self.verify_ms:
            return
        self.verify_ms[n_tokens] = 0.95 * self.verify_ms[n_tokens] + 0.05 * ms
        sizes = list(self.verify_ms)
        i = sizes.index(n_tokens)
        for n in sizes[:i]:  # a smaller verify costs no more
            self.verify_ms[n] = min(self.verify_ms[n], self.verify_ms[n_tokens])
        for n in sizes[i + 1:]:  # a bigger one no less
            self.verify_ms[n] = max(self.verify_ms[n], self.verify_ms[n_tokens])

    def verify_cost(self, n_tokens: int) -> float:
        """ms of verifying n_tokens, interpolated between the measured sizes."""
        return float(np.interp(n_tokens, list(self.verify_ms), list(self.verify_ms.values())))

    def begin(self) -> None:
        """A new text: whether drafting pays is judged afresh (a hard stretch of the last text had
        backed off up to MAX_SKIP rounds, which carried into the next prompt); the calibration and
        the costs, properties of the head and the machine, carry over."""
        self.skip = self.backoff = 0
        self.gain_ms = 0.0
        self.probe = True

    def should_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _best(self, probs: np.ndarray, depths: np.ndarray,
              extra_ms: float = 0.0) -> tuple[int, float, np.ndarray]:
        """(drafted nodes, value, predicted accepted per depth class before calibration) of the best
        size for candidate probabilities `probs` (descending) at `depths`; 0 nodes is plain decoding.
        Value: expected tokens minus the round's ms at the recent rate; the draft already spent is sunk."""
        rate = self.rate
        best = (0, 1.0 - rate * self.verify_ms[1], np.zeros(N_CLASSES))
        by_class = np.zeros((len(probs), N_CLASSES))
        by_class[np.arange(len(probs)), np.minimum(depths, N_CLASSES) - 1] = probs
        cum = np.concatenate([np.zeros((1, N_CLASSES)), np.cumsum(by_class, axis=0)])
        expected = cum @ self.calibration
        for n, ms in self.verify_ms.items():
            if n == 1 or n - 1 > len(probs):
                continue
            value = 1.0 + float(expected[n - 1]) - rate * (ms + extra_ms)
            if value > best[1]:
                best = (n - 1, value, cum[n - 1])
        return best

    def choose(self, builder: TreeBuilder) -> int:
        """The drafted nodes to verify. The first draft and the first after skipped rounds verify at
        least the likeliest node: the calibration learns only from verified nodes, so a draft whose
        probabilities undersell it would otherwise never be tried again."""
        scores, depths = builder.candidates()
        probs = np.exp(scores)
        n, _, self.last_predicted = self._best(probs, depths)
        if n == 0 and self.probe and len(probs):
            n, self.last_predicted = 1, np.eye(N_CLASSES)[0] * probs[0]  # the likeliest node: depth 1
        self.probe = False
        return n

    def keep_expanding(self, builder: TreeBuilder) -> bool:
        """Whether one more level is expected to beat the best tree of the candidates so far, after
        paying for its decode. The new nodes are guessed as each frontier node's probability times
        the probabilities, given their parent, of the likeliest frontier node and its siblings (the
        draft about as sure one level down).
        A bound (every new node as likely as the likeliest frontier node) expanded nearly every
        round, and the rounds' draft time then ate what they gained."""
        scores, depths = builder.candidates()
        probs = np.exp(scores)
        _, value_now, _ = self._best(probs, depths)
        frontier = np.exp(builder.frontier_scores())
        n_new = min(builder.top_k * len(frontier), max(self.verify_ms) - 1)
        guess = np.outer(frontier, builder.last_conditionals()).ravel()
        new = np.sort(guess)[::-1][:n_new]
        all_probs = np.concatenate([probs, new])
        all_depths = np.concatenate([depths, np.full(len(new), depths.max() + 1)])
        order = np.argsort(-all_probs, kind="stable")
        _, value_next, _ = self._best(all_probs[order], all_depths[order], extra_ms=self.decode_ms)
        return value_next > value_now

    def observe(self, n_drafted: int, n_accepted: int, draft_ms: float, n_decodes: int,
                verify_ms: float | None = None) -> None:
        """After a round: n_decodes = 0 when the draft was skipped; verify_ms, what this round's
        verify took, corrects the table (a cached table can be off: measured on a busier or quieter
        machine, or before the model's pages were warm).

        Whether drafting pays is judged on the round's predicted gain (calibrated draft probabilities,
        measured costs), not on its accepted count: one round accepts all or nothing, and a running
        average of such samples flips sign often enough to back off from drafts that pay on average."""
        if verify_ms is not None:
            self._update_verify_cost(n_drafted + 1, verify_ms)
        round_ms = draft_ms + (verify_ms if verify_ms is not None else self.verify_cost(n_drafted + 1))
        self.tokens_sum = RATE_DECAY * self.tokens_sum + 1 + n_accepted
        self.ms_sum = RATE_DECAY * self.ms_sum + round_ms
        if n_decodes == 0:
            self.caught_up = False
            self.probe = True
            return
        if n_drafted > 0:
            # accepted at depth 1, and beyond it (a round accepts one path)
            accepted = np.array([min(n_accepted, 1), max(n_accepted - 1, 0)])
            self.accepted_sum = DECAY * self.accepted_sum + accepted
            self.predicted_sum = DECAY * self.predicted_sum + self.last_predicted
        if self.caught_up or self.decode_ms == 0:
            per_decode = draft_ms / n_decodes
            self.decode_ms = per_decode if self.decode_ms == 0 else 0.9 * self.decode_ms + 0.1 * per_decode
        else:
            # after skipped rounds the catch-up decode is bigger than a drafting round's own
            draft_ms = self.decode_ms * n_decodes
        self.caught_up = True
        predicted = float(self.calibration @ self.last_predicted) if n_drafted > 0 else 0.0
        gain = (1.0 + predicted) * self.verify_ms[1] - (draft_ms + self.verify_cost(n_drafted + 1))
        self.gain_ms = (1.0 - GAIN_WEIGHT) * self.gain_ms + GAIN_WEIGHT * gain
        if gain >= 0:
            self.backoff = 0
        elif self.gain_ms < 0:
            # a losing round skips drafts only when recent rounds lose on average: one whose draft was
            # unsure says little about the next (with the 0.5B's head, a round after a losing one
            # still accepts 31% of first tokens, against 43%, where 19% pays)
            self.skip = self.backoff
            self.backoff = min(2 * self.backoff + 1, MAX_SKIP)
