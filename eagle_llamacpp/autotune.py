"""tree="auto": pick the verified tree size that maximizes expected tokens per second.

The verify latency of each tree size is measured once per model and machine and cached. Each round,
EAGLE-2's observation that a node's cumulative draft probability predicts its acceptance gives the
expected accepted tokens of the best N candidates, scaled by how well that prediction has matched
the acceptance observed so far in this engine.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from . import _native as nat
from .models import cache_dir
from .tree import TreeBuilder

SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # verified tokens, root included


def _machine_key(target, n_threads: int, n_gpu_layers: int) -> str:
    st = os.stat(target.path)
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    raw = f"{target.path.name}|{st.st_size}|{cpu}|{os.cpu_count()}|{n_threads}|{n_gpu_layers}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def measure_verify_ms(target, sizes=SIZES, reps: int = 3) -> dict[int, float]:
    """Median time of one tree verify per size (a random chain-shaped tree; shape barely matters,
    see benchmarks/tree_verify.py), after a short prefix. Leaves the target's memory empty."""
    rng = np.random.default_rng(0)
    nat.clear_memory(target.ctx)
    prefix = rng.integers(0, target.n_vocab, 32)
    target.decode(prefix, np.arange(len(prefix)), outputs=np.zeros(len(prefix), np.int8))
    out = {}
    for n in sizes:
        parents = np.arange(n) - 1
        times = []
        for _ in range(reps + 1):  # the first run allocates the graph for this size
            t0 = time.perf_counter()
            target.decode(rng.integers(0, target.n_vocab, n), len(prefix) + np.arange(n),
                          tree=(np.arange(n), parents))
            times.append(time.perf_counter() - t0)
            nat.tree_commit(target.ctx, [])
        out[n] = float(np.median(times[1:]) * 1e3)
    nat.clear_memory(target.ctx)
    return out


class AutoTreeSize:
    def __init__(self, target, *, n_threads: int, n_gpu_layers: int, max_tokens: int):
        self.sizes = [n for n in SIZES if n <= max_tokens]
        path = cache_dir() / "autotune" / f"{_machine_key(target, n_threads, n_gpu_layers)}.json"
        cached = json.loads(path.read_text()) if path.is_file() else {}
        if all(str(n) in cached for n in self.sizes):
            self.verify_ms = {n: cached[str(n)] for n in self.sizes}
        else:
            self.verify_ms = measure_verify_ms(target, self.sizes)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({**cached, **{str(k): v for k, v in self.verify_ms.items()}}))
        self.calibration = 1.0  # observed / predicted accepted tokens, running average
        self.draft_ms = 0.0
        self.last_expected = 0.0

    def choose(self, builder: TreeBuilder) -> int:
        """Drafted node count (root excluded) with the best expected tokens per ms."""
        probs = np.exp(builder.candidate_scores())
        best, best_rate = 1, -1.0
        for n in self.sizes:
            expected = 1.0 + self.calibration * float(probs[:n - 1].sum())  # + the bonus token
            rate = expected / (self.draft_ms + self.verify_ms[n])
            if rate > best_rate:
                best, best_rate = n - 1, rate
                self.last_expected = expected - 1.0
        return min(best, len(probs))

    def observe(self, n_accepted: int, draft_ms: float) -> None:
        if self.last_expected > 0:
            ratio = n_accepted / self.last_expected
            # floored, so that a bad stretch does not switch speculation off for good
            self.calibration = max(0.05, 0.9 * self.calibration + 0.1 * min(ratio, 4.0))
        self.draft_ms = draft_ms if self.draft_ms == 0 else 0.9 * self.draft_ms + 0.1 * draft_ms
