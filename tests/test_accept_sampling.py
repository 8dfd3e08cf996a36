"""The sampling acceptor follows the target distribution exactly (chi-square, fixed seed)."""

import numpy as np
import pytest
from scipy.stats import chisquare

from eagle_llamacpp.accept import sample_accept, target_distribution
from eagle_llamacpp.tree import DraftTree

SIGNIFICANCE = 1e-3  # reject "same distribution" below this p-value
N_SAMPLES = 20_000

# root -> [2, 0, 3]; node 1 (token 2) -> [1, 4]; node 4 (token 1) -> [0]
TREE = DraftTree(tokens=np.array([9, 2, 0, 3, 1, 4, 0]), parents=np.array([-1, 0, 0, 0, 1, 1, 4]),
                 scores=np.zeros(7))


def emitted(path, bonus):
    return [int(TREE.tokens[i]) for i in path[1:]] + [bonus]


def run(accept, probs, seed=0):
    rng = np.random.default_rng(seed)
    return [emitted(*accept(TREE, probs, rng)) for _ in range(N_SAMPLES)]


def p_value(samples, p):
    counts = np.bincount(samples, minlength=len(p))
    support = p > 0
    if counts[~support].any():
        return 0.0  # a token the warped target can never produce came out
    return chisquare(counts[support], p[support] * len(samples)).pvalue


@pytest.fixture
def probs():
    rng = np.random.default_rng(42)
    V = 10
    logits = rng.normal(size=(TREE.n, 10)) * 1.5
    return np.stack([target_distribution(row, temperature=1.0, top_k=8, top_p=0.95) for row in logits]), V


def test_first_and_second_tokens_follow_the_target(probs):
    p, _ = probs
    out = run(sample_accept, p)
    assert p_value([s[0] for s in out], p[0]) > SIGNIFICANCE
    # given that the first token was 2 (node 1), the second follows the target after node 1
    second = [s[1] for s in out if s[0] == 2]
    assert len(second) > 1000
    assert p_value(second, p[1]) > SIGNIFICANCE
    # and deeper still: after 2, 1 (node 4)
    third = [s[2] for s in out if s[:2] == [2, 1]]
    assert p_value(third, p[4]) > SIGNIFICANCE


def test_the_check_catches_a_biased_acceptor(probs):
    """Negative control: accepting the first child whenever p(t) > 0 is not lossless, and is caught."""
    p, _ = probs

    def biased(tree, target_probs, rng):
        kids = tree.children(0)
        if target_probs[0][tree.tokens[kids[0]]] > 0:
            return [0, int(kids[0])], int(rng.choice(len(target_probs[0]), p=target_probs[int(kids[0])]))
        return [0], int(rng.choice(len(target_probs[0]), p=target_probs[0]))

    out = run(biased, p)
    assert p_value([s[0] for s in out], p[0]) < SIGNIFICANCE


def test_target_distribution_warping():
    logits = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    p = target_distribution(logits, temperature=1.0, top_k=2)
    assert np.count_nonzero(p) == 2 and p[0] > p[1]
    p = target_distribution(logits, temperature=1.0, top_p=0.5)
    assert np.count_nonzero(p) == 1  # the top token alone already holds > 50%
    p = target_distribution(logits, temperature=1.0, min_p=0.3)
    assert np.count_nonzero(p) == 2  # e^-1 = 0.37 of the top token survives, e^-2 does not
    cold = target_distribution(logits, temperature=0.1)
    assert cold[0] > 0.999
    np.testing.assert_allclose(target_distribution(logits).sum(), 1.0)
    # top-p is taken before the temperature, as in llama.cpp: a hot temperature widens nothing
    assert np.count_nonzero(target_distribution(logits, temperature=5.0, top_p=0.5)) == 1
