"""Pure numpy tests of the EAGLE-2 tree builder and greedy acceptance: no model at all."""

import numpy as np
import pytest

from eagle_llamacpp.accept import greedy_accept
from eagle_llamacpp.tree import DraftTree, TreeBuilder, top_k_desc


def logprobs(pairs, V=8):
    """A log-probability row with the given {token: logprob}, the rest far below."""
    row = np.full(V, -50.0)
    for t, lp in pairs.items():
        row[t] = lp
    return row


def test_worked_example_from_the_reference():
    # k=2, depth=1, N=3: a=-0.1, b=-1.0; aa=-0.3, ab=-2.0 (cumulative); ba=-1.5, bb=-2.5
    a, b, aa, ab, ba, bb, root = 1, 2, 3, 4, 5, 6, 7
    tb = TreeBuilder(top_k=2, depth=1, total_tokens=3)
    f = tb.begin(logprobs({a: -0.1, b: -1.0}))
    assert list(f.tokens) == [a, b]
    tb.expand(np.stack([logprobs({aa: -0.2, ab: -1.9}), logprobs({ba: -0.5, bb: -1.5})]))
    tree = tb.build(root)
    assert list(tree.tokens) == [root, a, b, aa]
    assert list(tree.parents) == [-1, 0, 0, 1]
    assert list(tree.depths) == [0, 1, 1, 2]
    np.testing.assert_allclose(tree.scores, [0, -0.1, -1.0, -0.3])
    assert tree.ancestor_mask().astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree.retrieve_indices().tolist() == [[0, 1, 3], [0, 2, -1]]


def test_last_conditionals_are_the_likeliest_frontier_node_and_its_siblings():
    tb = TreeBuilder(top_k=2, depth=2, total_tokens=10)
    tb.begin(logprobs({1: -0.1, 2: -1.0}))
    np.testing.assert_allclose(tb.last_conditionals(), np.exp([-0.1, -1.0]))
    # frontier: 3 (cumulative -0.3) and 5 (-1.01); 3 and its sibling 4 given token 1: -0.2, -1.9
    tb.expand(np.stack([logprobs({3: -0.2, 4: -1.9}), logprobs({5: -0.01, 6: -1.5})]))
    np.testing.assert_allclose(tb.last_conditionals(), np.exp([-0.2, -1.9]))


def test_frontier_is_the_global_top_k_and_pairs_with_parent_rows():
    tb = TreeBuilder(top_k=2, depth=2, total_tokens=10)
    tb.begin(logprobs({1: -0.1, 2: -0.2}))
    # both best children hang off row 1 (token 2): the frontier is not per parent
    f = tb.expand(np.stack([logprobs({3: -3.0, 4: -4.0}), logprobs({5: -0.1, 6: -0.3})]))
    assert list(f.tokens) == [5, 6]
    assert list(f.source_rows) == [1, 1]  # their feature is the draft output of row 1
    assert list(f.parent_flat) == [1, 1]  # candidate id of token 2


def test_top_k_one_is_a_chain():
    rng = np.random.default_rng(0)
    tb = TreeBuilder(top_k=1, depth=4, total_tokens=5)
    tb.begin(np.log(rng.dirichlet(np.ones(16))))
    for _ in range(4):
        tb.expand(np.log(rng.dirichlet(np.ones(16), size=1)))
    tree = tb.build(0)
    assert list(tree.parents) == [-1, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("seed", range(20))
def test_random_trees_are_connected_scored_and_bounded(seed):
    rng = np.random.default_rng(seed)
    k, depth, n_total, V = int(rng.integers(1, 5)), int(rng.integers(0, 5)), int(rng.integers(1, 30)), 12
    tb = TreeBuilder(k, depth, n_total)
    f = tb.begin(np.log(rng.dirichlet(np.ones(V))))
    for _ in range(depth):
        f = tb.expand(np.log(rng.dirichlet(np.ones(V), size=len(f.tokens))))
    tree = tb.build(99)
    assert 1 <= tree.n <= n_total + 1
    assert np.all(tree.parents[1:] < np.arange(1, tree.n))
    # cumulative scores never rise along a path, and siblings come in descending score order
    assert np.all(tree.scores[1:] <= tree.scores[tree.parents[1:]] + 1e-12)
    for i in range(tree.n):
        kids = tree.children(i)
        assert np.all(np.diff(tree.scores[kids]) <= 1e-12)
        assert len(set(tree.tokens[kids].tolist())) == len(kids)  # no duplicate sibling tokens
    mask = tree.ancestor_mask()
    for i in range(tree.n):
        assert set(np.flatnonzero(mask[i])) == set(tree.path_to(i))
        assert mask[i].sum() == tree.depths[i] + 1
    # every leaf appears exactly once in the retrieve indices
    rows = tree.retrieve_indices()
    last = [r[r >= 0][-1] for r in rows]
    assert sorted(last) == sorted(tree.leaves().tolist())


def test_build_keeps_the_tree_connected():
    # with real log-probabilities (<= 0) and ties broken toward lower ids a child never outranks
    # its parent; scores above 0 force the case to check the guard: the orphan is dropped
    tb = TreeBuilder(top_k=2, depth=1, total_tokens=2)
    tb.begin(logprobs({1: -1.0, 2: -2.0}))
    tb.expand(np.stack([logprobs({3: -5.0, 4: -6.0}), logprobs({5: 5.0, 6: -6.0})]))
    tree = tb.build(0)
    assert list(tree.tokens) == [0, 1] and list(tree.parents) == [-1, 0]


def test_top_k_desc_ties_to_lower_index():
    assert top_k_desc(np.array([0.5, 1.0, 1.0, 0.2]), 3).tolist() == [1, 2, 0]


def test_tree_validation():
    with pytest.raises(ValueError):
        DraftTree(np.array([1, 2]), np.array([-1, 1]), np.zeros(2))


def test_greedy_accept_follows_the_target_argmax():
    # root r -> a(1) -> aa(3); root -> b(2)
    tree = DraftTree(np.array([7, 10, 11, 12]), np.array([-1, 0, 0, 1]), np.zeros(4))
    # target after root says 10 (a), after a says 12 (aa), after aa says 42: bonus
    path, bonus = greedy_accept(tree, np.array([10, 12, 0, 42]))
    assert path == [0, 1, 3] and bonus == 42
    # target after root says 11 (b), then 5: b accepted, bonus 5
    path, bonus = greedy_accept(tree, np.array([11, 0, 5, 0]))
    assert path == [0, 2] and bonus == 5
    # no child matches: only the root, and the target's own token
    path, bonus = greedy_accept(tree, np.array([99, 0, 0, 0]))
    assert path == [0] and bonus == 99
