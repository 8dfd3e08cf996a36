"""tree="auto"'s policy in plain numbers: the size it picks, when it stops drafting, and how it
corrects a verify-cost table that was measured off."""

import numpy as np

from eagle_llamacpp.autotune import MAX_SKIP, AutoPolicy


def test_drafts_only_what_beats_plain_decoding():
    policy = AutoPolicy({1: 20.0, 2: 38.0, 3: 42.0})
    # one likely node: 1.95 tokens per 38 ms beats 1 per 20 ms; a less likely one does not
    assert policy._best(np.array([0.95]))[0] == 1
    assert policy._best(np.array([0.8]))[0] == 0
    # two fair nodes pay at three verified tokens: (1 + 0.7 + 0.5) / 42 > 1 / 20
    assert policy._best(np.array([0.7, 0.5]))[0] == 2


def test_losing_rounds_back_off_up_to_max_skip():
    policy = AutoPolicy({1: 20.0, 2: 38.0})
    skipped = []
    for _ in range(12):
        assert policy.should_draft()
        policy.observe(n_drafted=1, n_accepted=0, draft_ms=2.0, n_decodes=1)  # lost 20 ms
        n = 0
        while not policy.should_draft():
            n += 1
        skipped.append(n)
        policy.skip = 0
    assert skipped[:4] == [0, 1, 3, 7] and max(skipped) == MAX_SKIP
    # a round that gains ends the back-off
    for _ in range(10):
        policy.observe(n_drafted=1, n_accepted=1, draft_ms=1.0, n_decodes=1, verify_ms=25.0)
    assert policy.backoff == 0


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
