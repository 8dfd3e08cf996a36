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


def target_distribution(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0,
                        top_p: float = 1.0) -> np.ndarray:
    """The warped target distribution: temperature, then top-p, then top-k (EAGLE's order)."""
    z = np.asarray(logits, dtype=np.float64) / max(temperature, 1e-8)
    keep = np.ones(z.shape, dtype=bool)
    order = np.argsort(-z, kind="stable")
    if 0.0 < top_p < 1.0:
        p = np.exp(z[order] - z[order[0]])
        cum = np.cumsum(p / p.sum())
        n_keep = int(np.searchsorted(cum, top_p) + 1)  # the smallest prefix reaching top_p
        keep[order[n_keep:]] = False
    if top_k > 0:
        keep[order[top_k:]] = False
    z = np.where(keep, z, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def sample_accept(tree: DraftTree, target_probs: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """Lossless acceptance for deterministic (top-k) drafts.

    target_probs[i] is the warped target distribution after node i. At each accepted node the
    children are tried in order: child token t is accepted with probability p(t); on rejection
    p(t) is zeroed and p renormalized. The bonus token is sampled from what remains, so every
    emitted token follows the target distribution exactly, whatever the draft proposed.
    """
    node = 0
    path = [0]
    while True:
        p = np.array(target_probs[node], dtype=np.float64)
        accepted = None
        seen = set()
        for c in tree.children(node):
            t = int(tree.tokens[c])
            if t in seen:
                continue
            seen.add(t)
            if rng.random() < p[t]:
                accepted = int(c)
                break
            p[t] = 0.0
            p /= p.sum()
        if accepted is None:
            return path, int(rng.choice(len(p), p=p))
        path.append(accepted)
        node = accepted
