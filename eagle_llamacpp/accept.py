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
                        top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """The warped target distribution, in llama.cpp's sampler order (as llama-cpp-python's
    Llama builds it): top-k, top-p, min-p, then temperature.

    Only the surviving candidates are sorted, so a top-k keeps this cheap on a 150k vocabulary.
    """
    z = np.asarray(logits, dtype=np.float64)
    if 0 < top_k < z.size:
        cand = np.argpartition(-z, top_k - 1)[:top_k]
    else:
        cand = np.arange(z.size)
    cand = cand[np.lexsort((cand, -z[cand]))]  # descending logit, ties to the lower id
    zc = z[cand]
    if 0.0 < top_p < 1.0:
        pc = np.exp(zc - zc[0])
        cum = np.cumsum(pc / pc.sum())
        zc = zc[:int(np.searchsorted(cum, top_p) + 1)]  # the smallest prefix reaching top_p
    if min_p > 0.0:
        zc = zc[np.exp(zc - zc[0]) >= min_p]
    zc = zc / max(temperature, 1e-8)
    pc = np.exp(zc - zc[0])
    p = np.zeros(z.size)
    p[cand[:len(zc)]] = pc / pc.sum()
    return p


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
