"""Tree batches (patch 0004): one decode verifies a whole token tree.

Every node of a random tree must get the logits and feature that decoding its root-to-node path as
a plain chain gives; committing a path must leave exactly prefix + path in the KV cache.
"""

import numpy as np
import pytest

from eagle_llamacpp import _native as nat
from eagle_llamacpp.draft import TargetModel

# max |tree - chain| / max |chain|, over the logits and the feature row of every node. Not zero:
# matmuls over batches of different sizes round differently before K and V go into the f16 cache.
# Measured worst cases: 3.5e-5 with flash attention off, 3.5e-7 with it on.
TOL = {False: 1e-3, True: 1e-3}

VOCAB = 320  # tests/tiny_models.py


def random_tree(rng, n_nodes: int, max_depth: int, n_roots: int = 1):
    """Parent index (-1 for roots) and depth of each node; parents come before their children."""
    parents, depth = [-1] * n_roots, [0] * n_roots
    while len(parents) < n_nodes:
        open_ = [i for i, d in enumerate(depth) if d < max_depth]
        p = int(rng.choice(open_))
        parents.append(p)
        depth.append(depth[p] + 1)
    return np.array(parents[:n_nodes]), np.array(depth[:n_nodes])


def path_to(parents, j):
    path = []
    while j >= 0:
        path.append(j)
        j = parents[j]
    return path[::-1]


def tree_shapes(rng):
    """(n_nodes, max_depth, n_roots): edge cases first, then random shapes up to 64 nodes, depth 8."""
    shapes = [(1, 0, 1), (2, 1, 1), (9, 8, 1), (64, 1, 1), (64, 8, 1), (12, 3, 2)]
    shapes += [(int(rng.integers(2, 65)), int(rng.integers(1, 9)), 1) for _ in range(6)]
    return shapes


def decode_tree(model, prefix_len, tree_tokens, parents, depth, node_ids, seq_id=0):
    parent_ids = np.where(parents >= 0, node_ids[np.maximum(parents, 0)], -1)
    model.decode(tree_tokens, prefix_len + depth, tree=(node_ids, parent_ids), seq_ids=seq_id)


def outputs(model, n):
    return [(model.logits(i), model.feature(i)) for i in range(n)]


def chain_reference(ref, prefix, tree_tokens, parents):
    """(logits, feature) of every node, from decoding prefix + its path as a chain."""
    out = []
    for j in range(len(tree_tokens)):
        path = path_to(parents, j)
        toks = tree_tokens[path]
        outs = np.zeros(len(toks), np.int8)
        outs[-1] = 1
        ref.decode(toks, len(prefix) + np.arange(len(toks)), outputs=outs)
        out.append((ref.logits(len(toks) - 1), ref.feature(len(toks) - 1)))
        nat.seq_rm(ref.ctx, 0, len(prefix))
    return out


def rel_err(got, want):
    return max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for pair in zip(got, want)
               for g, w in zip(*pair))


@pytest.fixture(scope="module", params=[False, True], ids=["fa-off", "fa-on"])
def flash_attn(request):
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tree_nodes_equal_chain_decoding(targets, arch, flash_attn):
    path = targets[arch][0]
    # a tree of 64 nodes spans 4 ubatches of 16: ancestors also come from earlier ubatches
    tree_model = TargetModel(path, n_ctx=256, n_batch=64, n_ubatch=16, flash_attn=flash_attn)
    ref = TargetModel(path, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    rng = np.random.default_rng(1)
    worst = 0.0
    for n_nodes, max_depth, n_roots in tree_shapes(rng):
        prefix = rng.integers(3, VOCAB, size=int(rng.integers(1, 20)))
        for m in (tree_model, ref):
            nat.clear_memory(m.ctx)
            m.decode(prefix, np.arange(len(prefix)))
        parents, depth = random_tree(rng, n_nodes, max_depth, n_roots)
        tokens = rng.integers(3, VOCAB, size=n_nodes)
        node_ids = rng.permutation(1000)[:n_nodes]  # node ids are not batch indices
        decode_tree(tree_model, len(prefix), tokens, parents, depth, node_ids)
        err = rel_err(outputs(tree_model, n_nodes), chain_reference(ref, prefix, tokens, parents))
        worst = max(worst, err)
        assert err < TOL[flash_attn], (n_nodes, max_depth, n_roots, err)
        # dropping the whole tree leaves the prefix
        tree_model.tree_commit([])
        assert nat.seq_pos_max(tree_model.ctx) == len(prefix) - 1
    print(f"{arch} fa={flash_attn}: worst rel err {worst:.2e}")


def test_siblings_do_not_see_each_other(targets):
    """Control: the same tokens without the tree mask (plain positions) give different outputs."""
    path = targets["llama"][0]
    model = TargetModel(path, n_ctx=128, n_batch=32)
    ref = TargetModel(path, n_ctx=128, n_batch=32)
    prefix = np.array([5, 6, 7, 8])
    tokens = np.array([10, 11, 12, 13])
    parents, depth = np.array([-1, 0, 0, 0]), np.array([0, 1, 1, 1])
    for m in (model, ref):
        m.decode(prefix, np.arange(4))
    decode_tree(model, 4, tokens, parents, depth, np.arange(4))
    want = chain_reference(ref, prefix, tokens, parents)
    assert rel_err(outputs(model, 4), want) < TOL[False]
    # as a chain, node 3 would see its siblings 1 and 2: its logits differ
    ref.decode(tokens, 4 + np.arange(4))
    assert np.max(np.abs(ref.logits(3) - want[3][0])) > 1e-2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_commit_keeps_prefix_and_path(targets, arch, flash_attn):
    path = targets[arch][0]
    model = TargetModel(path, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    ref = TargetModel(path, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    rng = np.random.default_rng(2)
    history = list(rng.integers(3, VOCAB, size=5))
    model.decode(history, np.arange(len(history)))
    for _ in range(6):  # rounds: verify a tree, commit a path, then decode one plain token
        parents, depth = random_tree(rng, int(rng.integers(1, 40)), int(rng.integers(1, 9)))
        tokens = rng.integers(3, VOCAB, size=len(parents))
        node_ids = rng.permutation(len(parents))
        decode_tree(model, len(history), tokens, parents, depth, node_ids)
        accepted = path_to(parents, int(rng.integers(len(parents))))
        model.tree_commit(node_ids[accepted])
        history += list(tokens[accepted])
        assert nat.seq_pos_min(model.ctx) == 0
        assert nat.seq_pos_max(model.ctx) == len(history) - 1

        nxt = int(rng.integers(3, VOCAB))
        model.decode([nxt], [len(history)])
        history.append(nxt)
        nat.clear_memory(ref.ctx)
        ref.decode(history, np.arange(len(history)))
        err = rel_err([(model.logits(0), model.feature(0))], [(ref.logits(len(history) - 1),
                                                             ref.feature(len(history) - 1))])
        assert err < TOL[flash_attn], err


def fill_free_cells(model, pos0):
    """Decodes plain tokens until the KV cache is full; returns how many fitted."""
    n_free = 0
    while True:
        try:
            model.decode([7], [pos0 + n_free])
        except nat.EagleError as e:
            assert "(1)" in str(e)  # 1: no KV slot, the cache is full
            return n_free
        n_free += 1


def test_1000_rounds_leak_no_cell(targets):
    model = TargetModel(targets["llama"][0], n_ctx=256, n_batch=64)
    n_cells = nat.llama_cpp.llama_n_ctx(model.ctx)
    rng = np.random.default_rng(3)
    model.decode([1, 5, 6], [0, 1, 2])
    pos_min, pos_next = 0, 3
    for _ in range(1000):
        parents, depth = random_tree(rng, int(rng.integers(1, 25)), int(rng.integers(1, 9)))
        tokens = rng.integers(3, VOCAB, size=len(parents))
        node_ids = rng.permutation(64)[:len(parents)]
        decode_tree(model, pos_next, tokens, parents, depth, node_ids)
        if rng.random() < 0.1:
            model.tree_commit([])
        else:
            accepted = path_to(parents, int(rng.integers(len(parents))))
            model.tree_commit(node_ids[accepted])
            pos_next += len(accepted)
        assert nat.seq_pos_max(model.ctx) == pos_next - 1
        if pos_next - pos_min > 64:  # keep the committed context short, as a sliding window
            pos_min = pos_next - 32
            nat.seq_rm(model.ctx, 0, 0, pos_min)
        assert nat.seq_pos_min(model.ctx) == pos_min
    # exactly the committed cells are in use: all others can be filled, and no more
    assert fill_free_cells(model, pos_next) == n_cells - (pos_next - pos_min)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified", "split"])
def test_two_sequences_verify_in_one_decode(targets, kv_unified, flash_attn):
    path = targets["qwen2"][0]
    model = TargetModel(path, n_ctx=512, n_batch=128, n_seq_max=2, kv_unified=kv_unified,
                        flash_attn=flash_attn)
    ref = TargetModel(path, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    rng = np.random.default_rng(4)
    prefixes = [rng.integers(3, VOCAB, size=7), rng.integers(3, VOCAB, size=11)]
    trees = [random_tree(rng, 30, 6), random_tree(rng, 17, 8)]
    tokens = [rng.integers(3, VOCAB, size=len(t[0])) for t in trees]
    for s in range(2):
        model.decode(prefixes[s], np.arange(len(prefixes[s])), seq_ids=s)
    # one decode, both trees interleaved; both use node ids 0..n-1 (ids are per sequence)
    order = np.concatenate([np.arange(30), np.arange(17)])
    seqs = np.concatenate([np.zeros(30, int), np.ones(17, int)])
    perm = np.argsort(np.concatenate([np.arange(30) * 2, np.arange(17) * 2 + 1]), kind="stable")
    order, seqs = order[perm], seqs[perm]
    all_tokens = np.array([tokens[s][j] for j, s in zip(order, seqs)])
    all_pos = np.array([len(prefixes[s]) + trees[s][1][j] for j, s in zip(order, seqs)])
    all_parents = np.array([trees[s][0][j] for j, s in zip(order, seqs)])
    model.decode(all_tokens, all_pos, tree=(order, all_parents), seq_ids=seqs)
    for s in range(2):
        nat.clear_memory(ref.ctx)
        ref.decode(prefixes[s], np.arange(len(prefixes[s])))
        want = chain_reference(ref, prefixes[s], tokens[s], trees[s][0])
        got = [None] * len(tokens[s])
        for i in np.flatnonzero(seqs == s):
            got[order[i]] = (model.logits(int(i)), model.feature(int(i)))
        assert rel_err(got, want) < TOL[flash_attn], s
    # each sequence commits its own path
    for s in range(2):
        accepted = path_to(trees[s][0], len(tokens[s]) - 1)
        model.tree_commit(accepted, seq_id=s)
        assert nat.seq_pos_max(model.ctx, s) == len(prefixes[s]) + len(accepted) - 1


def test_bad_tree_batches_and_commits_are_rejected(targets):
    model = TargetModel(targets["llama"][0], n_ctx=128, n_batch=32)
    model.decode([1, 5, 6], [0, 1, 2])
    bad = [
        ("parent not decoded", [3, 4], [3, 4], [0, 9], [-1, 7]),
        ("position not parent + 1", [3, 4], [3, 5], [0, 1], [-1, 0]),
        ("root not after the prefix", [3], [5], [0], [-1]),
        ("node id used twice", [3, 4, 5], [3, 4, 4], [0, 1, 1], [-1, 0, 0]),
    ]
    for what, toks, pos, nodes, parents in bad:
        with pytest.raises(nat.EagleError, match="llama_decode failed"):
            model.decode(toks, pos, tree=(nodes, parents))
        assert nat.seq_pos_max(model.ctx) == 2, what
    with pytest.raises(nat.EagleError, match="invalid tree node"):
        model.decode([3], [3], tree=([-2], [-1]))

    # a tree of root 0 with children 1, 2 and grandchild 3 (under 1)
    model.decode([3, 4, 5, 6], [3, 4, 4, 5], tree=([0, 1, 2, 3], [-1, 0, 0, 1]))
    with pytest.raises(nat.EagleError, match="llama_decode failed"):
        model.decode([9], [3])  # a plain token while the tree is open
    for keep in ([0, 1, 2], [1, 3], [0, 3], [0, 7], [0, 0]):
        with pytest.raises(nat.EagleError, match="tree commit"):
            model.tree_commit(keep)
    assert nat.seq_pos_max(model.ctx) == 5  # nothing changed
    model.tree_commit([0, 1, 3])
    assert nat.seq_pos_max(model.ctx) == 5
    model.decode([9], [6])
    with pytest.raises(nat.EagleError, match="tree commit"):
        model.tree_commit([0])  # already committed: no open tree any more


@pytest.mark.parametrize("kept", [1, 2], ids=["first-sibling", "second-sibling"])
def test_commit_keeps_the_cells_in_position_order(smollm2, flash_attn, kept):
    """After keeping a sibling decoded after another one, the next token must see what decoding the
    path one token at a time gives. Regression: the kept cell stayed behind the removed sibling's
    cell, the next token took that hole, and CPU flash attention, which rounds by cell order, moved
    SmolLM2's log-probabilities by up to 0.54."""
    model = TargetModel(smollm2, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    prompt = model.tokenize("Once upon a time", True)
    n = len(prompt)

    def log_softmax(x):
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    def prefill():
        nat.clear_memory(model.ctx)
        model.decode(prompt, np.arange(n), outputs=np.zeros(n, np.int8))

    siblings = [339, 260]
    prefill()
    for tok, pos in ((28, n), (siblings[kept - 1], n + 1), (2240, n + 2), (282, n + 3)):
        model.decode([tok], [pos])
    want = log_softmax(model.logits(0))

    prefill()
    model.decode([28, *siblings], [n, n + 1, n + 1], tree=(np.arange(3), np.array([-1, 0, 0])))
    model.tree_commit([0, kept])
    model.decode([2240], [n + 2])
    model.decode([282], [n + 3])
    got = log_softmax(model.logits(0))
    assert float(np.max(np.abs(got - want))) < 1e-3
