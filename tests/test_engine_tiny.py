"""EagleLlama on a tiny random target: sampling follows the target's own distribution; limits.

Sampling: the joint distribution of the first 3 generated tokens over thousands of seeds is compared
(chi-square) with the exact target-only distribution, computed from the target's logits. The random
head alone would almost never propose a token the target keeps, so an oracle puts the target's likely
tokens into the tree (in random order): the acceptor then accepts, rejects and renormalizes on every
round, which is what must not bias the output.
"""

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
from oracle import OracleProposer
from scipy import stats as sps

from eagle_llamacpp import _native as nat
from eagle_llamacpp.accept import target_distribution
from eagle_llamacpp.convert import convert
from eagle_llamacpp.engine import EagleLlama, Sampling
from eagle_llamacpp.random_head import head_for_target
from eagle_llamacpp.stats import SpecStats

SAMPLING = dict(temperature=1.0, top_k=4, top_p=0.8, min_p=0.0)
N_SEEDS = 3000
ALPHA = 1e-3      # significance: a correct engine fails this test once in a thousand seeds of the suite
PROMPT = [1, 300, 301, 302]


def make_engine(targets, tmp, draft_vocab=None):
    """The tiny llama target with an untrained head; draft_vocab=N: the head's lm_head covers N tokens."""
    target = targets["llama"][0]
    head = head_for_target(target, tmp / "head")
    if draft_vocab:
        (head / "draft_vocab.json").write_text(json.dumps(np.random.default_rng(5).permutation(320).tolist()))
    draft = convert(head, tmp / "draft.gguf", target=target, outtype="f32", draft_vocab=draft_vocab)
    return EagleLlama(target, draft, n_ctx=64, n_threads=2, flash_attn=False, tree=(8, 3, 3))


@pytest.fixture(scope="module")
def engine(targets, tmp_path_factory):
    e = make_engine(targets, tmp_path_factory.mktemp("sampling-head"))
    yield e
    e.close()


@pytest.fixture(scope="module")
def engine_draft_vocab(targets, tmp_path_factory):
    e = make_engine(targets, tmp_path_factory.mktemp("sampling-head-vocab"), draft_vocab=64)
    assert e.draft.n_draft_vocab == 64
    yield e
    e.close()


def exact_joint(engine, n: int) -> dict[tuple, float]:
    """P(first n generated tokens) under plain target sampling, by enumerating the kept tokens."""
    t = engine.target

    def dist(tokens):
        nat.clear_memory(t.ctx)
        t.decode(tokens, np.arange(len(tokens)), outputs=np.eye(len(tokens), dtype=np.int8)[-1])
        return target_distribution(t.logits(len(tokens) - 1), **SAMPLING)

    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for seq, p in joint.items():
            q = dist(PROMPT + list(seq))
            for tok in np.flatnonzero(q):
                nxt[seq + (int(tok),)] = p * q[tok]
        joint = nxt
    return joint


def follow_target(joint, n_prompt):
    """Oracle: below each tree node whose context is still inside the first 3 tokens, the children
    get the target's kept tokens for that context, shuffled (extra children keep the draft's)."""
    def pick(oracle, tree):
        def fill(node, context):
            if len(context) >= 3:
                return
            support = sorted({seq[len(context)] for seq in joint if seq[:len(context)] == context})
            kids = tree.children(node)
            for k, tok in zip(kids, oracle.rng.permutation(support)):
                tree.tokens[k] = tok
                fill(int(k), context + (int(tok),))
        generated = tuple(oracle.history[n_prompt:])
        fill(0, generated)
    return pick


def sample_first_tokens(engine, joint, n_seeds, stats=None) -> dict[tuple, int]:
    """Counts the first 3 sampled tokens over n_seeds seeds, the oracle filling every tree."""
    counts = dict.fromkeys(joint, 0)
    real = engine.proposer
    for seed in range(n_seeds):
        engine.proposer = OracleProposer(real, PROMPT, np.random.default_rng(10_000 + seed),
                                         follow_target(joint, len(PROMPT)))
        try:
            out = tuple(itertools.islice(engine.generate(PROMPT, 3, Sampling(seed=seed, **SAMPLING), stats), 3))
        finally:
            engine.proposer = real
        assert out in counts, f"seed {seed}: {out} has probability 0 under the target"
        counts[out] += 1
    return counts


def chisquare(joint, counts, n_seeds):
    """Chi-square of counts against joint, pooling outcomes expected fewer than 5 times into one cell."""
    keys = sorted(joint, key=joint.get, reverse=True)
    exp = np.array([joint[k] * n_seeds for k in keys])
    obs = np.array([counts[k] for k in keys], dtype=float)
    big = exp >= 5
    exp = np.append(exp[big], exp[~big].sum())
    obs = np.append(obs[big], obs[~big].sum())
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    chi2, p = sps.chisquare(obs, exp)
    return chi2, p, len(exp)


@pytest.mark.parametrize("which", ["engine", "engine_draft_vocab"])
def test_sampling_matches_the_target_distribution(which, request):
    engine = request.getfixturevalue(which)
    joint = exact_joint(engine, 3)
    assert 4 <= len(joint) <= 64 and abs(sum(joint.values()) - 1) < 1e-9
    # top_p must actually cut: fewer than top_k^3 outcomes
    assert len(joint) < 64

    stats = SpecStats()
    counts = sample_first_tokens(engine, joint, N_SEEDS, stats)

    # the trees were really used: drafted tokens accepted at depth 1 and 2, and some rejected
    d = stats.as_dict()
    assert stats.accepted_at_depth[0] > 0.3 * stats.rounds and stats.accepted_at_depth[1] > 0
    assert d["accepted"] < d["drafted"]

    chi2, p, cells = chisquare(joint, counts, N_SEEDS)
    print(f"{len(joint)} outcomes, {cells} cells, chi2 {chi2:.1f}, p {p:.3f}, stats {d}")
    assert p > ALPHA


def test_a_biased_acceptor_is_caught(engine, monkeypatch):
    """Negative control: an acceptor that always takes the first child when its token is kept at all
    is not lossless, and the same check with the same seeds must reject it."""
    import eagle_llamacpp.engine as eng

    def first_kept_child(tree, probs, rng):
        node, path = 0, [0]
        while True:
            p = probs[node]
            kids = [int(c) for c in tree.children(node) if p[int(tree.tokens[c])] > 0]
            if not kids:
                return path, int(rng.choice(len(p), p=p))
            node = kids[0]
            path.append(node)

    monkeypatch.setattr(eng, "sample_accept", first_kept_child)
    joint = exact_joint(engine, 3)
    n = N_SEEDS // 3
    counts = sample_first_tokens(engine, joint, n)
    assert chisquare(joint, counts, n)[1] < ALPHA


def test_full_context_finishes_with_length(engine):
    prompt = [1] + [300 + i % 20 for i in range(engine.n_ctx - 40)]
    out = list(engine.generate(prompt, 10 ** 6, Sampling(temperature=0)))
    if engine.last_finish_reason == "stop":  # the random target may pick its EOS: then it must be last
        assert out[-1] == 2 and len(prompt) + len(out) <= engine.n_ctx + 1
    else:
        assert engine.last_finish_reason == "length"
        assert len(prompt) + len(out) == engine.n_ctx + 1  # the last token is generated, never decoded
    r = engine.create_completion(prompt, max_tokens=None, temperature=0)
    assert r["choices"][0]["finish_reason"] == engine.last_finish_reason
    assert r["usage"]["completion_tokens"] == len(out) - (engine.last_finish_reason == "stop")
    # exactly max_tokens
    r = engine.create_completion(prompt[:8], max_tokens=13, temperature=0)
    assert r["usage"]["completion_tokens"] == 13 and r["choices"][0]["finish_reason"] == "length"
    with pytest.raises(nat.EagleError, match="the context holds"):
        list(engine.generate([1] * engine.n_ctx, 4))


def test_draft_for_another_target_fails_at_construction(engine, targets, tmp_path):
    from tiny_models import write_target

    narrow = tmp_path / "narrow.gguf"
    write_target(narrow, "llama", n_embd=32, n_head=4, n_head_kv=4, n_ff=64)
    with pytest.raises(nat.EagleError, match="hidden size 64 does not match the target's 32"):
        EagleLlama(narrow, engine.draft.path, n_ctx=64, n_threads=2, tree=(4, 2, 2))
    # same width and vocabulary: another family, or another depth, is refused too
    with pytest.raises(nat.EagleError, match="made for a 2-layer llama target, this target is a 2-layer qwen2"):
        EagleLlama(targets["qwen2"][0], engine.draft.path, n_ctx=64, n_threads=2, tree=(4, 2, 2))
    deeper = tmp_path / "deeper.gguf"
    write_target(deeper, "llama", n_layer=3)
    with pytest.raises(nat.EagleError, match="this target is a 3-layer llama"):
        EagleLlama(deeper, engine.draft.path, n_ctx=64, n_threads=2, tree=(4, 2, 2))
    # the same shape under another name loads, with a warning
    renamed = tmp_path / "renamed.gguf"
    write_target(renamed, "llama", n_head_kv=4, name="another-llama")
    with pytest.warns(UserWarning, match="was made for 'tiny-llama', the target is 'another-llama'"):
        EagleLlama(renamed, engine.draft.path, n_ctx=64, n_threads=2, tree=(4, 2, 2)).close()


def run_generate(*args):
    return subprocess.run([sys.executable, "-m", "eagle_llamacpp.cli", "generate", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def test_cli_generate_prints_text_and_stats(engine, targets):
    target, draft = targets["llama"][0], engine.draft.path
    r = run_generate("--target", target, "--draft", draft, "-p", "w5 w6 w7", "-n", 12, "--temp", 0,
                     "--tree", "6,3,2", "-t", 2, "-c", 128)
    assert r.returncode == 0, r.stderr
    want = engine.create_completion("w5 w6 w7", max_tokens=12, temperature=0)["choices"][0]["text"]
    assert r.stdout == want + "\n"
    assert "generated 12 tokens" in r.stderr and "mean acceptance length" in r.stderr

    # bad input: one line on stderr, no traceback
    r = run_generate("--target", target, "--draft", target, "-p", "w5")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "is not an EAGLE-1/2 draft" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_generate("--target", target, "--draft", draft, "-p", "w5", "--tree", "1,2")
    assert r.returncode == 2 and "expected auto or TOTAL,DEPTH,TOP_K" in r.stderr


def test_on_round_reports_each_tree_and_its_accepted_path(engine):
    """engine.on_round (diagnostics, benchmarks/node_calibration.py) sees every verified tree and the
    accepted path, root first: its accepted tokens, each round's bonus after them, are the output."""
    from oracle import follow_reference

    greedy = Sampling(temperature=0.0)
    reference = list(engine.generate(PROMPT, 24, greedy))
    rounds = []
    real = engine.proposer
    engine.proposer = OracleProposer(real, PROMPT, np.random.default_rng(3), follow_reference(reference, len(PROMPT)))
    engine.on_round = lambda tree, path: rounds.append((tree, [int(i) for i in path]))
    try:
        out = list(engine.generate(PROMPT, 24, greedy))
    finally:
        engine.proposer, engine.on_round = real, None
    assert out == reference
    k = 1  # the prompt's decode gives the first token
    for tree, path in rounds:
        assert path[0] == 0 and all(tree.parents[b] == a for a, b in zip(path, path[1:]))
        assert [int(t) for t in tree.tokens[path[1:]]] == out[k:k + len(path) - 1]
        k += len(path)  # the accepted tokens and the bonus
    assert k >= len(out) and any(len(path) > 1 for _, path in rounds)


def test_engines_share_one_loaded_target(engine, targets):
    """A second engine on the same target file decodes with the first one's target (one copy of the
    weights), gives the same greedy text, and closing it leaves the first one working."""
    prompt, greedy = PROMPT, Sampling(temperature=0.0)
    want = list(engine.generate(prompt, 12, greedy))
    other = EagleLlama(targets["llama"][0], engine.draft.path, n_threads=2, tree=(4, 2, 2), share_target=engine)
    assert other.target is engine.target and other.n_ctx == engine.n_ctx
    assert list(other.generate(prompt, 12, greedy)) == want
    other.close()
    assert engine.target.ctx is not None
    assert list(engine.generate(prompt, 12, greedy)) == want
    with pytest.raises(ValueError, match="share_target decodes"):
        EagleLlama(targets["qwen2"][0], engine.draft.path, n_threads=2, share_target=engine)
