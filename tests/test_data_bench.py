"""ShareGPT parsing and the benchmark-prompt exclusion; the benchmark's bookkeeping."""

import json

from eagle_llamacpp.bench import Result, markdown, pick_questions, summarize
from eagle_llamacpp.data import Question, read_sharegpt, training_conversations


def _record(i, turns):
    return {"id": str(i), "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_reader_recovers_records_of_a_truncated_file(tmp_path):
    records = [
        _record(0, [("human", "hi"), ("gpt", "hello"), ("human", "bye")]),   # odd tail turn dropped
        _record(1, [("gpt", "orphan"), ("human", "q"), ("gpt", "a")]),      # leading reply dropped
        _record(2, [("human", "only a question")]),                         # nothing to learn: dropped
        _record(3, [("human", "x"), ("gpt", "")]),                          # empty reply: dropped
        _record(4, [("human", "last"), ("gpt", "complete")]),
    ]
    text = json.dumps(records, indent=1)
    cut = text + ', {"id": "5", "conversations": [{"from": "human", "val'   # cut mid-record
    path = tmp_path / "sg.json"
    path.write_text(text[:-1] + cut[len(text):])
    convs = read_sharegpt(path)
    assert convs == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        [{"role": "user", "content": "last"}, {"role": "assistant", "content": "complete"}],
    ]


def test_training_data_never_holds_a_benchmark_question(tmp_path):
    question = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture."
    records = [_record(i, [("human", f"question {i} about something else entirely"), ("gpt", "ok")]) for i in range(20)]
    records[7] = _record(7, [("human", "Please help. " + question.upper() + " Thanks"), ("gpt", "sure")])
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(records))
    convs = training_conversations(path=path, exclude=[Question(81, "writing", (question, "second turn"))])
    assert len(convs) == 19
    assert not any("hawaii" in c[0]["content"].lower() for c in convs)
    # the same seed gives the same order
    assert convs == training_conversations(path=path, exclude=[Question(81, "writing", (question, "x"))])


def test_questions_are_picked_round_robin_over_categories():
    qs = [Question(i, c, (f"q{i}",)) for i, c in enumerate(["a", "a", "a", "b", "b", "c"])]
    assert [q.question_id for q in pick_questions(4, qs)] == [0, 3, 5, 1]
    assert len(pick_questions(100, qs)) == 6


def test_summary_ratios_and_acceptance_length():
    rs = [
        Result("plain", 1, "a", 11, 2.0, 10, tokens=list(range(11))),
        Result("plain", 2, "b", 5, 1.0, 4, tokens=[1, 2, 3, 4, 5]),
        Result("eagle", 1, "a", 11, 1.0, 4, drafted=20, accepted=6, tokens=list(range(11))),
        Result("eagle", 2, "b", 5, 0.5, 2, drafted=8, accepted=2, tokens=[1, 2, 3, 4, 6]),
    ]
    s = summarize(rs, ["plain", "eagle"])
    assert s["plain"]["tokens_per_s"] == round(16 / 3.0, 3)
    assert s["eagle"]["speedup_vs_plain"] == round((16 / 1.5) / (16 / 3.0), 3)
    # tokens after the prompt's own token, per target decode
    assert s["eagle"]["acceptance_length"] == round(14 / 6, 3)
    assert s["plain"]["acceptance_length"] == 1.0
    assert s["eagle"]["draft_acceptance_rate"] == round(8 / 28, 3)
    assert s["eagle"]["same_tokens_as_plain"] == 1
    assert s["eagle"]["by_category"]["a"]["speedup_vs_plain"] == 2.0
    table = markdown(s, 2)
    assert "| eagle | 10.67 | 2.00 |" in table


def test_bench_compares_several_heads_in_one_run(targets, tmp_path, monkeypatch):
    """`bench --head A --head B`: one auto-tree row per head and draft vocabulary, named by folder."""
    import argparse

    import pytest

    from eagle_llamacpp.cli import bench_drafts
    from eagle_llamacpp.random_head import head_for_target

    monkeypatch.setenv("EAGLE_LLAMACPP_CACHE", str(tmp_path / "cache"))
    target, _ = targets["qwen2"]
    a, b = head_for_target(target, tmp_path / "old"), head_for_target(target, tmp_path / "new", seed=1)
    for head in (a, b):
        (head / "draft_vocab.json").write_text(json.dumps(list(range(3, 300))))
    drafts = bench_drafts(argparse.Namespace(draft=None, head=[str(a), str(b)], draft_vocab="0,40"), target, tmp_path)
    assert list(drafts) == ["-old-fullvocab", "-old-vocab40", "-new-fullvocab", "-new-vocab40"]
    assert len(set(drafts.values())) == 4 and all(p.exists() for p in drafts.values())
    one = bench_drafts(argparse.Namespace(draft=None, head=[str(a)], draft_vocab="40"), target, tmp_path)
    assert one == {"-vocab40": drafts["-old-vocab40"]}
    # auto: the converter's default, labelled by the size it came out at (here all 297 listed tokens,
    # fewer than the default size)
    auto = bench_drafts(argparse.Namespace(draft=None, head=[str(a)], draft_vocab="auto"), target, tmp_path)
    assert list(auto) == ["-vocab297"]
    with pytest.raises(SystemExit, match="sizes and 'auto'"):
        bench_drafts(argparse.Namespace(draft=None, head=[str(a)], draft_vocab="big"), target, tmp_path)
    with pytest.raises(SystemExit, match="distinct names"):
        bench_drafts(argparse.Namespace(draft=None, head=[str(a), str(a)], draft_vocab="40"), target, tmp_path)
    # the in-process methods decode with one loaded copy of the target, and all give its greedy tokens
    from eagle_llamacpp.bench import PythonMethods

    py = PythonMethods(target, 2, 64, {"old": (drafts["-old-vocab40"], dict(tree=(4, 2, 2))),
                                       "new": (drafts["-new-fullvocab"], dict(tree=(5, 2, 3)))})
    try:
        assert all(llm.target is py.plain_target for llm in py.engines.values())
        q = Question(1, "writing", ("hi",))
        runs = {name: py.run(name, [1, 300, 301], 10, q).tokens for name in py.names()}
    finally:
        py.close()
    assert runs["old"] == runs["new"] == runs["plain"] and len(runs["plain"]) == 10
