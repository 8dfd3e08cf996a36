"""tree="auto"'s policy in plain numbers: the size it picks, when it stops drafting, and how it
corrects a verify-cost table that was measured off."""

import os
from types import SimpleNamespace

import numpy as np

from eagle_llamacpp.autotune import MAX_SKIP, AutoPolicy, _machine_key
from eagle_llamacpp.tree import TreeBuilder


def one_guess(p: float) -> TreeBuilder:
    """A draft whose best next token has probability p (p >= 0.05; the rest spread thin)."""
    builder = TreeBuilder(top_k=1, depth=1, total_tokens=2)
    builder.begin(np.log(np.array([p] + [(1 - p) / 20] * 20)))
    return builder


def test_drafts_only_what_beats_plain_decoding():
    policy = AutoPolicy({1: 20.0, 2: 38.0, 3: 42.0})
    # a fresh policy prices a ms at plain decoding's 1 token per 20 ms: one likely node adds 0.95
    # tokens for 18 ms (more than 0.05 per ms), a less likely one does not
    assert policy._best(np.array([0.95]), np.array([1]))[0] == 1
    assert policy._best(np.array([0.8]), np.array([1]))[0] == 0
    # two fair nodes pay at three verified tokens: 1.2 tokens for 22 ms
    assert policy._best(np.array([0.7, 0.5]), np.array([1, 1]))[0] == 2


def test_a_node_is_verified_when_it_beats_the_runs_own_rate():
    # a second node adds 0.35 tokens for 6 ms: (1 + 0.9 + 0.35) / 28 is a lower ratio than
    # (1 + 0.9) / 22 within the round, but 0.058 tokens per extra ms beats a run at plain
    # decoding's 0.05, so it raises the run's tokens per ms
    policy = AutoPolicy({1: 20.0, 2: 22.0, 3: 28.0})
    probs, depths = np.array([0.9, 0.35]), np.array([1, 1])
    assert policy._best(probs, depths)[0] == 2
    # once rounds run at 2 tokens per 25 ms (0.08 per ms), 0.058 no longer pays
    for _ in range(100):
        policy.observe(policy.choose(one_guess(0.9)), n_accepted=1, draft_ms=3.0, n_decodes=1, verify_ms=22.0)
    assert abs(policy.rate - 0.08) < 0.002
    assert policy._best(probs, depths)[0] == 1


def test_a_run_behind_plain_decoding_still_prices_its_time_at_plain_decodings_rate():
    policy = AutoPolicy({1: 20.0, 2: 38.0})
    # rounds that emit 1 token per 30 ms (slower than plain decoding's 20): a ms is still worth 1/20
    # token, so one node at 0.8 (1.8 tokens for 38 ms against 1 for 20) is not verified; priced at the
    # run's own 1/30 it would be (1.8 - 38/30 > 1 - 20/30)
    for _ in range(200):
        policy.observe(n_drafted=0, n_accepted=0, draft_ms=10.0, n_decodes=1, verify_ms=20.0)
    assert policy.tokens_sum / policy.ms_sum < 0.04
    assert policy.rate == 1 / 20.0
    assert policy._best(np.array([0.8]), np.array([1]))[0] == 0


def test_grows_a_level_only_where_the_draft_is_sure_enough_to_pay_for_it():
    # verify: 1 token 40 ms, 2: 42, 3: 50; a draft decode 3 ms
    policy = AutoPolicy({1: 40.0, 2: 42.0, 3: 50.0})
    policy.decode_ms = 3.0
    sure = TreeBuilder(top_k=1, depth=3, total_tokens=3)
    sure.begin(np.log(np.array([0.9, 0.05, 0.05])))
    # a ms is worth 1/40 token; the next level guessed at 0.9 * 0.9: 2.71 - 53/40 beats 1.9 - 42/40
    assert policy.keep_expanding(sure)
    unsure = TreeBuilder(top_k=1, depth=3, total_tokens=3)
    unsure.begin(np.log(np.array([0.5, 0.25, 0.25])))
    # 0.5 * 0.5: 1.75 - 53/40 loses to 1.5 - 42/40, though a bound at 0.5 would not:
    # 2.0 - 53/40 > 1.5 - 42/40
    assert not policy.keep_expanding(unsure)


def test_losing_rounds_back_off_up_to_max_skip():
    policy = AutoPolicy({1: 20.0, 2: 30.0})
    skipped = []
    for _ in range(12):
        # a draft that says 0.05 is not worth verifying, except that probes check it: a loss either way
        n = policy.choose(one_guess(0.05))
        policy.observe(n_drafted=n, n_accepted=0, draft_ms=2.0, n_decodes=1)
        n = 0
        while not policy.should_draft():
            policy.observe(n_drafted=0, n_accepted=0, draft_ms=0.0, n_decodes=0)
            n += 1
        skipped.append(n)
    assert skipped[:4] == [0, 1, 3, 7] and max(skipped) == MAX_SKIP
    # rounds that gain end the back-off: (1 + 0.95) * 20 ms of tokens for 1 + 30 ms
    for _ in range(10):
        assert policy.choose(one_guess(0.95)) == 1
        policy.observe(n_drafted=1, n_accepted=1, draft_ms=1.0, n_decodes=1, verify_ms=30.0)
    assert policy.backoff == 0


def test_unsure_rounds_among_paying_ones_keep_drafting():
    # a draft that pays (0.9, accepted) until two rounds say 0.05: those verify nothing, and the
    # next round drafts again, since recent rounds still gained on average
    policy = AutoPolicy({1: 20.0, 2: 22.0})
    for _ in range(10):
        n = policy.choose(one_guess(0.9))
        policy.observe(n, 1, 1.0, 1, verify_ms=22.0)
    for _ in range(2):
        n = policy.choose(one_guess(0.05))
        policy.observe(n, 0, 1.0, 1, verify_ms=20.0)
        assert n == 0
    assert policy.should_draft()


def test_a_new_text_drafts_again_and_keeps_the_calibration():
    policy = AutoPolicy({1: 20.0, 2: 30.0})
    for _ in range(6):  # a hard stretch: drafts lose, the policy backs off
        n = policy.choose(one_guess(0.05))
        policy.observe(n, 0, 2.0, 1)
    assert policy.skip > 0
    calibration = policy.calibration.copy()
    policy.begin()  # the next prompt
    assert policy.should_draft() and policy.probe and policy.backoff == 0
    assert np.array_equal(policy.calibration, calibration)


def drafting_share(p_accept: float, p_draft: float, seed: int = 0, rounds: int = 400,
                   verify=(38.7, 43.0), draft_ms: float = 2.6) -> float:
    """Share of rounds that verify a drafted node when the draft says p_draft and the target accepts
    with p_accept; default costs as measured on a 2-core Xeon with the 0.5B Q4_K_M (one token
    38.7 ms, two 43.0 ms, a draft decode 2.6 ms, a catch-up after skipped rounds the same)."""
    rng = np.random.default_rng(seed)
    policy = AutoPolicy({1: verify[0], 2: verify[1]})
    drafted = 0
    for _ in range(rounds):
        if not policy.should_draft():
            policy.observe(0, 0, 0.0, 0, verify_ms=verify[0])
            continue
        n = policy.choose(one_guess(p_draft))
        drafted += n > 0
        accepted = int(n > 0 and rng.random() < p_accept)
        policy.observe(n, accepted, draft_ms, 1, verify_ms=verify[n > 0])
    return drafted / rounds


def test_drafts_that_pay_on_average_keep_drafting():
    # one round accepts all or nothing; at 37% drafting still wins on average:
    # 1.37 * 38.7 = 53.0 ms of tokens for 2.6 + 43.0 ms
    assert min(drafting_share(0.37, 0.4, seed) for seed in range(3)) > 0.9
    # at 10% it loses (1.1 * 38.7 = 42.6 ms for 45.6 ms): probes only
    assert max(drafting_share(0.10, 0.4, seed) for seed in range(3)) < 0.2


def test_a_draft_that_undersells_itself_is_tried_and_learned():
    # the 1.5B F16 on the Xeon: one token 141.2 ms, two 168.8 ms, a draft 3.5 ms. The draft says
    # 0.15, below the 0.195 at which a 2-token verify pays on paper, but the target accepts 0.35:
    # 1.35 * 141.2 = 190.6 ms of tokens for 172.3 ms
    # (how soon the calibration gets there depends on the first probes' luck: 8 seeds)
    shares = [drafting_share(0.35, 0.15, seed, verify=(141.2, 168.8), draft_ms=3.5) for seed in range(8)]
    assert np.mean(shares) > 0.65 and np.median(shares) > 0.75


def test_a_catch_up_after_skipped_rounds_is_priced_as_a_usual_draft():
    policy = AutoPolicy({1: 38.7, 2: 43.0})
    for _ in range(5):
        n = policy.choose(one_guess(0.5))
        policy.observe(n, 1, 2.6, 1, verify_ms=43.0)
    policy.observe(0, 0, 0.0, 0, verify_ms=38.7)  # a skipped round: its pair waits for the next draft
    n = policy.choose(one_guess(0.5))
    policy.observe(n, 0, 30.0, 1, verify_ms=43.0)  # that draft decoded the waiting pairs too
    assert abs(policy.decode_ms - 2.6) < 1e-9 and policy.gain_ms > 0 and policy.skip == 0


def test_calibration_converges_to_the_observed_ratio():
    # the draft says 0.8, the target accepts half as often
    rng = np.random.default_rng(0)
    policy = AutoPolicy({1: 20.0, 2: 21.0})
    seen = []
    for _ in range(2000):
        n = policy.choose(one_guess(0.8))
        policy.observe(n, int(rng.random() < 0.4), 1.0, 1)
        seen.append(policy.calibration[0])
    # a running ratio of ~20 rounds wanders; its average sits on the ratio (not on its square root)
    assert abs(np.mean(seen[100:]) - 0.5) < 0.05


def chain_of_two(p_first: float, p_second: float) -> TreeBuilder:
    """A two-level chain draft: its first token has probability p_first, the second p_second given it."""
    builder = TreeBuilder(top_k=1, depth=2, total_tokens=3)
    builder.begin(np.log(np.array([p_first] + [(1 - p_first) / 20] * 20)))
    builder.expand(np.log(np.array([[p_second] + [(1 - p_second) / 20] * 20])))
    return builder


def test_first_and_deeper_tokens_are_calibrated_apart():
    # the draft says 0.5 then 0.8 (a path of 0.4); the target takes the first token 80% of the time
    # and the second after it 10%. Verifying one token yields (1 + 0.8) / 21 tokens per ms, two
    # (1 + 0.8 + 0.08) / 25: one pays. A single ratio for both (0.88 observed / 0.9 predicted) would
    # verify two: (1 + 0.98 * 0.9) / 25 > (1 + 0.98 * 0.5) / 21
    rng = np.random.default_rng(0)
    policy = AutoPolicy({1: 20.0, 2: 21.0, 3: 25.0})
    chosen = []
    for _ in range(300):
        n = policy.choose(chain_of_two(0.5, 0.8))
        first = rng.random() < 0.8
        accepted = int(first) + int(first and n == 2 and rng.random() < 0.1)
        policy.observe(n, accepted, 1.0, 1)
        chosen.append(n)
    assert abs(policy.calibration[0] - 1.6) < 0.3
    # the deeper ratio learns only while the second token is verified: it stops below the 0.86 at
    # which two would pay again, (1 + 0.8 + 0.86 * 0.4) / 25 = 1.8 / 21
    assert policy.calibration[1] < 0.85
    assert np.mean(np.array(chosen[100:]) == 1) > 0.9


def test_observed_verify_times_correct_the_table():
    # cached on a quieter machine: one token 15 ms; here it takes 25 ms
    policy = AutoPolicy({1: 15.0, 2: 36.0, 3: 42.0})
    for _ in range(150):
        policy.observe(n_drafted=0, n_accepted=0, draft_ms=0.0, n_decodes=0, verify_ms=25.0)
    assert abs(policy.verify_ms[1] - 25.0) < 0.1
    assert policy.verify_ms[2] == 36.0  # sizes not verified keep their measurement
    # 2 tokens verified faster than the table said: smaller sizes never cost more than bigger ones
    for _ in range(150):
        policy.observe(n_drafted=1, n_accepted=0, draft_ms=0.0, n_decodes=1, verify_ms=22.0)
    assert policy.verify_ms[2] < 22.1 and policy.verify_ms[1] <= policy.verify_ms[2] <= policy.verify_ms[3]


def test_cached_timings_belong_to_one_library_build(tmp_path, monkeypatch):
    """A rebuilt libggml (other kernels, e.g. a changed patch) must not reuse the last build's timings."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "libggml-cpu.so.0.1").write_bytes(b"kernels")
    os.symlink("libggml-cpu.so.0.1", lib / "libggml-cpu.so")
    (lib / "README").write_text("not a library")
    model = tmp_path / "target.gguf"
    model.write_bytes(b"gguf")
    target = SimpleNamespace(path=model)
    monkeypatch.setenv("EAGLE_LLAMACPP_LIB", str(lib))
    key = _machine_key(target, 2, 0, None)
    assert _machine_key(target, 2, 0, None) == key
    (lib / "README").write_text("other text")  # not a library: same build
    assert _machine_key(target, 2, 0, None) == key
    (lib / "libggml-cpu.so.0.1").write_bytes(b"other kernels")
    assert _machine_key(target, 2, 0, None) != key
    assert _machine_key(target, 2, 0, True) != _machine_key(target, 2, 0, None)


def test_cached_timings_belong_to_one_repacking_setting(tmp_path, monkeypatch):
    """Repacked weights run other kernels (AMX), so the two settings keep separate verify tables."""
    model = tmp_path / "target.gguf"
    model.write_bytes(b"gguf")
    target = SimpleNamespace(path=model)
    monkeypatch.delenv("EAGLE_LLAMACPP_REPACK", raising=False)
    default = _machine_key(target, 2, 0, None)
    monkeypatch.setenv("EAGLE_LLAMACPP_REPACK", "1")
    assert _machine_key(target, 2, 0, None) == default  # on by default, as in llama.cpp
    monkeypatch.setenv("EAGLE_LLAMACPP_REPACK", "0")
    assert _machine_key(target, 2, 0, None) != default
