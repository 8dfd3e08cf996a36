"""The proposer: grows an EAGLE-2 draft tree with the draft head, one tree level per draft decode.

The draft's KV cache holds only entries built from target features that the target confirmed:
position i pairs token x[i+1] with the target's feature f[i]. Confirmed pairs wait in `pending`
until the next draft, whose first decode takes them all, the root's pair last: its output gives
level 1 of the tree. Each further decode takes one level as a token tree of the draft context
(parents from earlier decodes stay visible to their children); the levels are dropped again once
the tree is built. A tree of `depth` levels therefore costs `depth` draft decodes.
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
    """EAGLE's tree knobs. total_tokens counts the root, as in EAGLE (so total_tokens - 1 drafted);
    depth counts the levels of drafted tokens, as the EAGLE-2 paper does (its code's depth + 1)."""

    total_tokens: int
    depth: int
    top_k: int

    def __post_init__(self):
        if self.total_tokens < 2 or self.depth < 1 or self.top_k < 1:
            raise ValueError(f"tree needs total_tokens >= 2, depth >= 1, top_k >= 1 (got {self})")


class FixedPolicy:
    """Always draft, every level, and verify the shape's total_tokens."""

    def __init__(self, shape: TreeShape):
        self.shape = shape

    def begin(self) -> None:
        pass

    def should_draft(self) -> bool:
        return True

    def keep_expanding(self, builder: TreeBuilder) -> bool:
        return True

    def choose(self, builder: TreeBuilder) -> int:
        return self.shape.total_tokens - 1

    def observe(self, n_drafted: int, n_accepted: int, draft_ms: float, n_decodes: int,
                verify_ms: float | None = None) -> None:
        pass


class EagleProposer:
    def __init__(self, draft: EagleDraft):
        self.draft = draft
        self.n_committed = 0                 # draft positions that hold confirmed (token, feature) pairs
        self.pending_tokens: list[int] = []  # confirmed pairs not decoded yet
        self.pending_feats: list[np.ndarray] = []
        self.root_logprobs = None            # draft log-probabilities after the last committed pair
        self.root_hidden = None              # draft hidden state there: the feature paired with level 1
        self.last_builder: TreeBuilder | None = None
        self.last_decodes = 0                # draft decodes of the last propose()

    def reset(self) -> None:
        self.draft.clear()
        self.n_committed = 0
        self.pending_tokens, self.pending_feats = [], []
        self.root_logprobs = self.root_hidden = None

    def commit(self, tokens, feats) -> None:
        """Queues confirmed pairs: tokens[j] is the token after the one whose target feature is feats[j]."""
        self.pending_tokens += [int(t) for t in tokens]
        self.pending_feats.append(np.asarray(feats, dtype=np.float32).reshape(len(tokens), -1))

    def propose(self, root_token: int, shape: TreeShape, policy=None, max_nodes: int | None = None) -> DraftTree:
        """The draft tree under root_token (the last pending token). policy (default FixedPolicy) may
        skip the draft, stop growing early and pick the drafted node count; max_nodes caps it."""
        policy = policy or FixedPolicy(shape)
        self.last_decodes = 0
        self.last_builder = None
        if not policy.should_draft() or max_nodes == 0:
            return _root_only(root_token)
        self.catch_up()
        builder = TreeBuilder(shape.top_k, shape.depth, shape.total_tokens - 1)
        frontier = builder.begin(self.root_logprobs)
        hidden = self.root_hidden[None, :]
        pos, levels = self.n_committed, 0
        for _ in range(shape.depth - 1):
            if not policy.keep_expanding(builder):
                break
            # frontier nodes are open-tree roots (parent -1) at level 1, below their parents after that
            parents = np.where(frontier.parent_flat >= 0, frontier.parent_flat, -1)
            logits, hidden = self.draft.run(self.draft.token_ids(frontier.tokens), hidden[frontier.source_rows],
                                            np.full(len(frontier.tokens), pos), tree=(frontier.flat, parents))
            self.last_decodes += 1
            levels += 1
            frontier = builder.expand(log_softmax(logits))
            pos += 1
        if levels:
            nat.tree_commit(self.draft.ctx, [])  # tree levels never stay in the draft cache
        self.last_builder = builder
        n_nodes = min(policy.choose(builder), max_nodes or shape.total_tokens - 1)
        if n_nodes <= 0:
            return _root_only(root_token)
        tree = builder.build(root_token, n_nodes)  # drafted tokens are draft-vocabulary indices
        return DraftTree(np.concatenate([[root_token], self.draft.token_ids(tree.tokens[1:])]).astype(np.int32),
                         tree.parents, tree.scores)

    def catch_up(self) -> None:
        """Decodes the pending pairs (n_batch at a time); the output of the last one, the root's pair,
        is the distribution of level 1."""
        if not self.pending_tokens:
            return
        tokens, feats = self.pending_tokens, np.concatenate(self.pending_feats)
        n_batch = nat.llama_cpp.llama_n_batch(self.draft.ctx)
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            logits, hidden = self.draft.run(chunk, feats[start:start + n_batch],
                                            self.n_committed + np.arange(len(chunk)), rows=[len(chunk) - 1])
            self.n_committed += len(chunk)
            self.last_decodes += 1
        self.pending_tokens, self.pending_feats = [], []
        self.root_logprobs = log_softmax(logits[-1])
        self.root_hidden = hidden[-1]


def _root_only(root_token: int) -> DraftTree:
    """Plain decoding's round: the root alone."""
    return DraftTree(np.array([root_token], np.int32), np.array([-1], np.int32), np.zeros(1))


class Timer:
    """Accumulates wall time of a block: `with timer: ...`."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self):
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self._t0
