"""The proposer: grows an EAGLE-2 draft tree with the draft head, one tree level per draft decode.

The draft's KV cache holds only entries built from target features that the target confirmed:
position i pairs token x[i+1] with the target's feature f[i]. Tree levels are decoded as a token
tree in the draft context (parents from earlier calls stay visible to their children) and are
dropped again once the tree is built.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from . import _native as nat
from .draft import EagleDraft
from .tree import DraftTree, TreeBuilder


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class TreeShape:
    """EAGLE's tree knobs. total_tokens counts the root, as in EAGLE (so total_tokens - 1 drafted)."""

    total_tokens: int
    depth: int
    top_k: int

    def __post_init__(self):
        if self.total_tokens < 2 or self.depth < 0 or self.top_k < 1:
            raise ValueError(f"tree needs total_tokens >= 2, depth >= 0, top_k >= 1 (got {self})")


class EagleProposer:
    def __init__(self, draft: EagleDraft):
        self.draft = draft
        self.n_committed = 0         # draft positions that hold confirmed (token, feature) pairs
        self.root_logprobs = None    # draft log-probabilities after the last committed position
        self.root_hidden = None      # draft hidden state there: the feature paired with level 1
        self.last_builder: TreeBuilder | None = None

    def reset(self) -> None:
        self.draft.clear()
        self.n_committed = 0
        self.root_logprobs = self.root_hidden = None

    def commit(self, tokens, feats) -> None:
        """Appends confirmed pairs: tokens[j] is the token after the one whose target feature is feats[j]."""
        n_batch = nat.llama_cpp.llama_n_batch(self.draft.ctx)
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            logits, hidden = self.draft.run(chunk, feats[start:start + n_batch],
                                            self.n_committed + np.arange(len(chunk)), rows=[len(chunk) - 1])
            self.n_committed += len(chunk)
        self.root_logprobs = log_softmax(logits[-1])
        self.root_hidden = hidden[-1]

    def propose(self, root_token: int, shape: TreeShape, choose_size=None) -> DraftTree:
        """Grows the tree under root_token; choose_size(builder) may pick the drafted node count."""
        builder = TreeBuilder(shape.top_k, shape.depth, shape.total_tokens - 1)
        frontier = builder.begin(self.root_logprobs)
        hidden = self.root_hidden[None, :]
        pos = self.n_committed
        for _ in range(shape.depth):
            # frontier nodes are open-tree roots (parent -1) at level 1, below their parents after that
            parents = np.where(frontier.parent_flat >= 0, frontier.parent_flat, -1)
            logits, hidden = self.draft.run(self.draft.token_ids(frontier.tokens),
                                            hidden[frontier.source_rows], np.full(len(frontier.tokens), pos),
                                            tree=(frontier.flat, parents))
            frontier = builder.expand(log_softmax(logits))
            pos += 1
        if shape.depth > 0:
            nat.tree_commit(self.draft.ctx, [])  # tree levels never stay in the draft cache
        self.last_builder = builder
        n_nodes = choose_size(builder) if choose_size else None
        tree = builder.build(root_token, n_nodes)  # drafted tokens are draft-vocabulary indices
        return DraftTree(np.concatenate([[root_token], self.draft.token_ids(tree.tokens[1:])]).astype(np.int32),
                         tree.parents, tree.scores)


class Timer:
    """Accumulates wall time of a block: `with timer: ...`."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self._t0
