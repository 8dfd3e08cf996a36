"""The scorer: one target decode verifies a whole draft tree (patch 0004's tree batch)."""

from __future__ import annotations

import numpy as np

from . import _native as nat
from .draft import TargetModel
from .tree import DraftTree


class TreeScorer:
    def __init__(self, target: TargetModel):
        self.target = target

    def score(self, tree: DraftTree, n_past: int) -> None:
        """Decodes the tree after n_past committed tokens: node i at position n_past + depth(i).

        Node ids are the tree's node indices, so commit() takes accepted nodes as they are. The root
        alone is decoded as plain decoding does, as an ordinary token.
        """
        if tree.n == 1:
            nat.decode(self.target.ctx, tree.tokens, [n_past])
            return
        nat.decode(self.target.ctx, tree.tokens, n_past + tree.depths, tree=(np.arange(tree.n), tree.parents))

    def argmax(self, i: int) -> int:
        return nat.argmax_ith(self.target.ctx, i, self.target.n_vocab)

    def logits(self, i: int) -> np.ndarray:
        return self.target.logits(i)

    def features(self, nodes) -> np.ndarray:
        """The target's features of these nodes, [len(nodes), n_embd]."""
        return nat.feature_rows(self.target.ctx, np.asarray(nodes), self.target.n_embd)

    def commit(self, tree: DraftTree, path: list[int]) -> None:
        """Keeps the accepted root path in the target's KV cache; the rest of the tree goes."""
        if tree.n > 1:
            nat.tree_commit(self.target.ctx, path)
