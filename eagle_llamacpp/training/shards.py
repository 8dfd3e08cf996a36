"""Training batches streamed from feature shards on disk: only a few shards are in memory at once,
so a head can train on millions of tokens of features without the RAM to hold them.

Each epoch visits the shards in a seeded order, a group of shards at a time, and shuffles the
sequences within a group. The order depends only on (seed, epoch), so the batch of any step is
known in advance and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from .features import FeatureShard, read_arrays


class ShardStream:
    """Sequences of feature shards, addressed by (shard, sequence) and loaded on demand."""

    def __init__(self, paths: list[Path], group: int = 4, cache: int | None = None):
        self.paths = [Path(p) for p in paths]
        self.group = max(1, group)
        self.cache_size = cache or self.group + 1
        self._cache: OrderedDict[int, FeatureShard] = OrderedDict()
        ids, lengths = [], []
        self.offsets = [read_arrays(p, "offsets")[0] for p in self.paths]
        for s, offsets in enumerate(self.offsets):
            n = np.diff(offsets)
            for q in np.flatnonzero(n > 2):
                ids.append((s, int(q)))
                lengths.append(int(n[q]))
        self.ids = np.asarray(ids, np.int64).reshape(-1, 2)
        self.lengths = np.asarray(lengths, np.int64)

    def __len__(self) -> int:
        return len(self.ids)

    def split(self, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Indices of training and held-out sequences (a seeded draw over all shards). Sequences
        with the same reply go to the same side: self-distilled data repeats replies (refusals,
        repeated prompts), and a held-out copy of a training reply would flatter the head."""
        keys = {}
        group = np.empty(len(self.ids), np.int64)
        for i, (tokens, mask) in enumerate(self._replies()):
            group[i] = keys.setdefault(tokens[mask.astype(bool)].tobytes(), len(keys))
        order = np.random.default_rng(seed).permutation(len(keys))
        held_groups = order[:max(1, int(len(keys) * fraction))]
        held = np.isin(group, held_groups)
        return np.flatnonzero(~held), np.flatnonzero(held)

    def _replies(self):
        """(tokens, mask) of every sequence, in index order, read without the features."""
        for s, (tokens, mask) in enumerate(self.tokens_and_masks()):
            offsets = self.offsets[s]
            for q in self.ids[self.ids[:, 0] == s, 1]:
                yield tokens[offsets[q]:offsets[q + 1]], mask[offsets[q]:offsets[q + 1]]

    def epoch_order(self, train_idx: np.ndarray, epoch: int, seed: int) -> np.ndarray:
        """train_idx in this epoch's order: shards shuffled, then sequences within each group of shards."""
        rng = np.random.default_rng([seed, epoch])
        shard_of = self.ids[train_idx, 0]
        shards = rng.permutation(len(self.paths))
        order = []
        for g in range(0, len(shards), self.group):
            members = train_idx[np.isin(shard_of, shards[g:g + self.group])]
            order.append(rng.permutation(members))
        return np.concatenate(order) if order else train_idx[:0]

    def tokens_and_masks(self):
        """(tokens, mask) of every shard, read without the features."""
        for p in self.paths:
            yield read_arrays(p, "tokens", "mask")

    def sequence(self, i: int):
        """(tokens, feats, mask) of sequence i."""
        s, q = (int(v) for v in self.ids[i])
        shard = self._cache.get(s)
        if shard is None:
            shard = FeatureShard.load(self.paths[s])
            self._cache[s] = shard
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(s)
        a, b = shard.offsets[q], shard.offsets[q + 1]
        return shard.tokens[a:b], shard.feats[a:b], shard.mask[a:b]

    def batch(self, idx, emb: np.ndarray):
        """Torch tensors (embedding of x[j+1], f[j], f[j+1], mask[j+1]) over sequences idx, zero-padded."""
        import torch

        seqs = [self.sequence(int(i)) for i in idx]
        t = max(len(s[0]) for s in seqs) - 1
        b, h = len(seqs), emb.shape[1]
        tok = np.zeros((b, t), np.int64)
        f_in = np.zeros((b, t, h), np.float32)
        f_out = np.zeros((b, t, h), np.float32)
        mask = np.zeros((b, t), np.float32)
        for r, (tokens, feats, m) in enumerate(seqs):
            n = len(tokens) - 1
            tok[r, :n], f_in[r, :n], f_out[r, :n], mask[r, :n] = tokens[1:], feats[:-1], feats[1:], m[1:]
        return (torch.from_numpy(emb[tok]), torch.from_numpy(f_in), torch.from_numpy(f_out),
                torch.from_numpy(mask))
