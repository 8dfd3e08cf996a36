"""Acceptance of a verified draft tree."""

from __future__ import annotations

import numpy as np

from .tree import DraftTree


def greedy_accept(tree: DraftTree, target_argmax: np.ndarray) -> tuple[list[int], int]:
    """Longest root-to-node path whose every token is the target's argmax after its parent.

    target_argmax[i] is the target's greedy token after node i. Returns (accepted node path,
    starting with the root, and the bonus token: the target's argmax after the last node).
    """
    node = 0
    path = [0]
    while True:
        want = int(target_argmax[node])
        nxt = next((int(c) for c in tree.children(node) if int(tree.tokens[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt
