"""Training features for an EAGLE head, taken from the patched llama.cpp itself so that they match
the (quantized) target exactly: each conversation is rendered with the target's chat template, and
one target decode yields the final hidden state of every token.

Shards are written as they fill up, so an interrupted extraction resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import _native as nat
from ..chat import ChatRenderer
from ..draft import TargetModel


@dataclass
class FeatureShard:
    tokens: np.ndarray    # int32 [n], all sequences concatenated
    feats: np.ndarray     # float16 [n, n_embd], the target's final hidden state of each token
    mask: np.ndarray      # uint8 [n], 1 on assistant tokens
    offsets: np.ndarray   # int64 [n_seq + 1], sequence boundaries

    def sequences(self):
        for a, b in zip(self.offsets[:-1], self.offsets[1:]):
            yield self.tokens[a:b], self.feats[a:b], self.mask[a:b]

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, tokens=self.tokens, feats=self.feats, mask=self.mask, offsets=self.offsets)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> FeatureShard:
        with np.load(path) as z:
            return cls(z["tokens"], z["feats"], z["mask"], z["offsets"])


def packed_features(target: TargetModel, seqs: list[np.ndarray]) -> list[np.ndarray]:
    """The final hidden state of every token of several sequences in one target decode, each its own
    sequence id from position 0, so that short conversations fill the batch as the target's prompt
    processing wants it (needs len(seqs) <= n_seq_max and their tokens <= n_batch)."""
    nat.clear_memory(target.ctx)
    lengths = [len(s) for s in seqs]
    target.decode(np.concatenate(seqs), np.concatenate([np.arange(n) for n in lengths]),
                  outputs=np.zeros(sum(lengths), np.int8), seq_ids=np.repeat(np.arange(len(seqs)), lengths))
    feats = nat.feature_rows(target.ctx, np.arange(sum(lengths)), target.n_embd).astype(np.float16)
    return np.split(feats, np.cumsum(lengths)[:-1])


MANIFEST = "manifest.json"


def read_manifest(folder: Path) -> dict:
    """A feature folder's manifest (see ShardWriter); {} for a folder not started yet."""
    path = Path(folder) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {}


class ShardWriter:
    """Appends sequences to numbered shards in a folder; manifest.json records the shards, the
    tokens stored, the wall time spent and whatever the producer needs to resume (`state`)."""

    def __init__(self, out_dir: Path, shard_tokens: int, state: dict):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / MANIFEST
        self.manifest = {"shards": [], "n_tokens": 0, "seconds": 0.0, **state, **read_manifest(self.out_dir)}
        self.shard_tokens = shard_tokens
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self.t_last = time.perf_counter()

    @property
    def n_pending(self) -> int:
        return sum(len(p[0]) for p in self.pending)

    @property
    def n_tokens(self) -> int:
        """Tokens stored and pending."""
        return self.manifest["n_tokens"] + self.n_pending

    def add(self, tokens: np.ndarray, feats: np.ndarray, mask: np.ndarray) -> None:
        self.pending.append((np.asarray(tokens, np.int32), np.asarray(feats, np.float16), np.asarray(mask, np.uint8)))

    def full(self) -> bool:
        return self.n_pending >= self.shard_tokens

    def flush(self, **state) -> None:
        """Writes the pending sequences as the next shard and records `state` with it."""
        if self.pending:
            name = f"shard-{len(self.manifest['shards']):04d}.npz"
            lengths = [len(p[0]) for p in self.pending]
            FeatureShard(*(np.concatenate([p[k] for p in self.pending]) for k in range(3)),
                         np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)).save(self.out_dir / name)
            self.manifest["shards"].append(name)
            self.manifest["n_tokens"] += sum(lengths)
            self.pending = []
        self.manifest.update(state)
        self.manifest["seconds"] += time.perf_counter() - self.t_last
        self.t_last = time.perf_counter()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.manifest))
        tmp.replace(self.path)  # a reader (or a crash) never sees half a manifest

    def shard_paths(self) -> list[Path]:
        return [self.out_dir / s for s in self.manifest["shards"]]


def extract(target: TargetModel, conversations, out_dir: Path, *, max_tokens: int, token_budget: int,
            shard_tokens: int = 16384, first_conv: int = 0, progress: bool = True) -> list[Path]:
    """Writes feature shards for conversations until token_budget tokens are stored; resumes from
    the shards already in out_dir (manifest.json records how far each run got). Conversations are
    packed into the target's batches (n_batch tokens, n_seq_max sequences: see packed_features);
    a batch depends only on where it starts, so a resumed run decodes the same batches. A fresh
    folder starts at conversation first_conv."""
    writer = ShardWriter(out_dir, shard_tokens, {"first_conv": first_conv, "n_conv": first_conv})
    renderer = ChatRenderer(target)
    n_batch = nat.llama_cpp.llama_n_batch(target.ctx)
    n_seq = max(1, nat.llama_cpp.llama_n_seq_max(target.ctx))
    if max_tokens > n_batch:
        raise ValueError(f"max_tokens {max_tokens} exceeds the target context's n_batch {n_batch}")
    bar = _progress(progress, token_budget, writer.n_tokens, "features")
    i = writer.manifest["n_conv"]
    rendered: dict[int, tuple] = {}  # the conversation that did not fit the last batch
    while writer.n_tokens < token_budget and i < len(conversations):
        batch, used = [], 0
        while i < len(conversations) and len(batch) < n_seq:
            tokens, mask = rendered.pop(i, None) or renderer.tokens_and_mask(conversations[i], max_tokens)
            if mask.sum() < 8:
                i += 1
                continue  # nothing to learn from
            if used + len(tokens) > n_batch:
                rendered[i] = (tokens, mask)
                break  # it starts the next batch
            batch.append((tokens, mask))
            used += len(tokens)
            i += 1
        if batch:
            feats = packed_features(target, [b[0] for b in batch])
            for (tokens, mask), f in zip(batch, feats):
                writer.add(tokens, f, mask)
            bar.update(used)
        if writer.pending and (writer.full() or writer.n_tokens >= token_budget or i == len(conversations)):
            writer.flush(n_conv=i)
    bar.close()
    return writer.shard_paths()


def _progress(enabled: bool, total: int, initial: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="tok", disable=not enabled, smoothing=0.1)
