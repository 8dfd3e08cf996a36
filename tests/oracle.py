"""A test double for the proposer: the real EAGLE proposer runs (so the draft cache is exercised),
then some tree tokens are replaced by what the target is known or likely to produce, so that
acceptance paths of every length are exercised (an untrained head is never accepted)."""

from __future__ import annotations

import numpy as np


class OracleProposer:
    def __init__(self, inner, prompt, rng, pick):
        self.inner, self.rng, self.pick = inner, rng, pick
        self.history = list(prompt[:1])  # commit() brings the rest: prompt[1:] + generated tokens

    def reset(self):
        self.inner.reset()

    def commit(self, tokens, feats):
        self.inner.commit(tokens, feats)
        self.history += [int(t) for t in tokens]

    @property
    def last_decodes(self):
        return self.inner.last_decodes

    def catch_up(self):
        self.inner.catch_up()

    def propose(self, root, shape, policy=None, max_nodes=None):
        tree = self.inner.propose(root, shape, policy, max_nodes)
        assert self.history[-1] == root
        self.pick(self, tree)
        return tree


def follow_reference(reference, n_prompt, p_follow=0.8):
    """Greedy oracle: the first-child chain copies the known greedy continuation, each level with
    probability p_follow (a miss ends the useful chain)."""
    def pick(oracle, tree):
        future = reference[len(oracle.history) - n_prompt:]
        node = 0
        for want in future:
            kids = tree.children(node)
            if len(kids) == 0 or oracle.rng.random() > p_follow:
                return
            k = int(kids[oracle.rng.integers(len(kids))])
            tree.tokens[k] = want
            node = k
    return pick
