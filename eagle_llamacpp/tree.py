"""EAGLE-2 dynamic draft trees in plain numpy: expansion bookkeeping, rerank, masks and paths.

Nodes are numbered parents first; node 0 is the root (the token the target sampled last).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def top_k_desc(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values, largest first; ties go to the lower index."""
    k = min(k, values.size)
    cand = np.arange(values.size)
    if k < values.size:
        # every index that can make the top k: all values >= the k-th largest (its ties included)
        kth = np.partition(values, values.size - k)[values.size - k]
        cand = np.flatnonzero(values >= kth)
    order = np.lexsort((cand, -values[cand]))  # primary: -value, secondary: index
    return cand[order[:k]]


@dataclass
class DraftTree:
    tokens: np.ndarray   # [n] int32, tokens[0] is the root
    parents: np.ndarray  # [n] int32, parents[0] == -1, parents[i] < i
    scores: np.ndarray   # [n] float, cumulative draft log-probability (root: 0)

    def __post_init__(self):
        n = len(self.tokens)
        if n == 0 or self.parents[0] != -1 or np.any(self.parents[1:] >= np.arange(1, n)) \
                or np.any(self.parents[1:] < 0):
            raise ValueError("a draft tree lists parents before their children, with node 0 as the root")

    @property
    def n(self) -> int:
        return len(self.tokens)

    @property
    def depths(self) -> np.ndarray:
        d = np.zeros(self.n, dtype=np.int32)
        for i in range(1, self.n):
            d[i] = d[self.parents[i]] + 1
        return d

    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: row i is true on node i's ancestors and on i itself."""
        m = np.eye(self.n, dtype=bool)
        for i in range(1, self.n):
            m[i] |= m[self.parents[i]]
        return m

    def children(self, i: int) -> np.ndarray:
        """Children of node i in node order, which is descending draft probability among siblings."""
        return np.flatnonzero(self.parents == i)

    def leaves(self) -> np.ndarray:
        is_parent = np.zeros(self.n, dtype=bool)
        is_parent[self.parents[1:]] = True
        return np.flatnonzero(~is_parent)

    def path_to(self, i: int) -> list[int]:
        path = []
        while i >= 0:
            path.append(int(i))
            i = int(self.parents[i])
        return path[::-1]

    def retrieve_indices(self) -> np.ndarray:
        """[n_leaves, max_depth+1] root-to-leaf node paths padded with -1, in lexicographic order."""
        paths = [self.path_to(leaf) for leaf in self.leaves()]
        width = max(len(p) for p in paths)
        big = self.n  # -1 sorts as +inf, so rows sharing a prefix stay together
        paths.sort(key=lambda p: p + [big] * (width - len(p)))
        return np.array([p + [-1] * (width - len(p)) for p in paths], dtype=np.int32)


@dataclass
class Frontier:
    """The nodes a draft forward decodes next: one query per node, all at the same depth."""

    tokens: np.ndarray       # [m] tokens to feed
    source_rows: np.ndarray  # [m] row of the previous draft output whose feature pairs with each token
    flat: np.ndarray         # [m] candidate ids of these nodes
    parent_flat: np.ndarray  # [m] candidate id of each node's parent (-1: the root)


class TreeBuilder:
    """The EAGLE-2 search: expand the global top_k per level by cumulative log-probability, then
    keep the best total_tokens candidates. Candidate ids are creation order, parents first."""

    def __init__(self, top_k: int, depth: int, total_tokens: int):
        if top_k < 1 or depth < 0 or total_tokens < 1:
            raise ValueError("need top_k >= 1, depth >= 0, total_tokens >= 1")
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self._tok: list[np.ndarray] = []
        self._score: list[np.ndarray] = []
        self._parent: list[np.ndarray] = []
        self._n = 0
        self._frontier: Frontier | None = None

    def _add(self, tokens, scores, parents) -> np.ndarray:
        ids = np.arange(self._n, self._n + len(tokens))
        self._tok.append(np.asarray(tokens, dtype=np.int32))
        self._score.append(np.asarray(scores, dtype=np.float64))
        self._parent.append(np.asarray(parents, dtype=np.int64))
        self._n += len(tokens)
        return ids

    def begin(self, root_logprobs: np.ndarray) -> Frontier:
        """Children of the root, from the draft's log-probabilities at the root position."""
        sel = top_k_desc(root_logprobs, self.top_k)
        ids = self._add(sel, root_logprobs[sel], np.full(len(sel), -1))
        self._frontier = Frontier(sel.astype(np.int32), np.zeros(len(sel), dtype=np.int64), ids,
                                  np.full(len(sel), -1))
        return self._frontier

    def expand(self, logprobs: np.ndarray) -> Frontier:
        """logprobs: [m, V], the draft's output for each node of the current frontier."""
        f = self._frontier
        frontier_scores = np.concatenate(self._score)[f.flat]
        child_tok = np.stack([top_k_desc(row, self.top_k) for row in logprobs])            # [m, k]
        child_lp = np.take_along_axis(logprobs, child_tok, axis=1)
        cum = child_lp + frontier_scores[:, None]
        ids = self._add(child_tok.ravel(), cum.ravel(), np.repeat(f.flat, child_tok.shape[1]))
        sel = top_k_desc(cum.ravel(), self.top_k)
        rows = sel // child_tok.shape[1]
        self._frontier = Frontier(child_tok.ravel()[sel].astype(np.int32), rows, ids[sel], f.flat[rows])
        return self._frontier

    def frontier_scores(self) -> np.ndarray:
        """Cumulative log-probabilities of the nodes the next level would expand."""
        return np.concatenate(self._score)[self._frontier.flat]

    def last_conditionals(self) -> np.ndarray:
        """Probabilities, given their parent, of the likeliest frontier node and its siblings,
        descending: how sure the draft was one level down, a guess at how sure it will be next."""
        scores, parents = np.concatenate(self._score), np.concatenate(self._parent)
        top = self._frontier.flat[np.argmax(scores[self._frontier.flat])]
        parent = parents[top]
        base = scores[parent] if parent >= 0 else 0.0
        return np.sort(np.exp(scores[parents == parent] - base))[::-1]

    def candidates(self) -> tuple[np.ndarray, np.ndarray]:
        """(cumulative log-probabilities, depths) of all candidates so far, best first (ties: the
        shallower first, as build keeps parents before their children); depth 1 is a child of the
        root."""
        scores = np.concatenate(self._score)
        depths = np.concatenate([np.full(len(level), d + 1) for d, level in enumerate(self._score)])
        order = np.lexsort((depths, -scores))
        return scores[order], depths[order]

    def build(self, root_token: int, total_tokens: int | None = None) -> DraftTree:
        """The top total_tokens candidates (default: the builder's), parents first, under the root."""
        scores = np.concatenate(self._score)
        parents = np.concatenate(self._parent)
        tokens = np.concatenate(self._tok)
        chosen = np.sort(top_k_desc(scores, total_tokens or self.total_tokens))
        node_of = {-1: 0}
        keep = []
        for c in chosen:  # ascending ids: a parent is always seen before its children
            if int(parents[c]) in node_of:  # drop orphans left by exact score ties
                node_of[int(c)] = len(keep) + 1
                keep.append(int(c))
        keep = np.array(keep, dtype=np.int64)
        return DraftTree(
            tokens=np.concatenate([[root_token], tokens[keep]]).astype(np.int32),
            parents=np.array([-1] + [node_of[int(parents[c])] for c in keep], dtype=np.int32),
            scores=np.concatenate([[0.0], scores[keep]]),
        )
