"""llama-server with `--spec-type draft-eagle2` (patch 0005) on SmolLM2-135M, through the official
openai client: the same tokens as the same server without speculation, greedy and seeded sampling,
streaming or not, one slot or several; bad requests get an error and the server stays up.

Equality is exact: a tree decode gives every node the logits of decoding its path one token at a
time (patch 0004 keeps the committed cells in position order, see test_tree_batch.py)."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from eagle_llamacpp.llama_server import LlamaServer

openai = pytest.importorskip("openai")

PROMPTS = ["def fibonacci(n):", "The capital of France is", "1, 2, 3, 4, 5,", "import numpy as np\n",
           "SELECT name FROM users WHERE"]
N_TOKENS = 32
N_CTX = 1024
# a fixed tree of four levels, drafted every round (auto would mostly not draft with this weak head):
# the shipped SmolLM2 head gets a few of its nodes accepted
EAGLE2_ARGS = ["--spec-type", "draft-eagle2", "--spec-draft-n-max", "6", "--spec-eagle2-depth", "4",
               "--spec-eagle2-top-k", "2", "--no-spec-eagle2-auto"]


@pytest.fixture(scope="module")
def plain(smollm2, tmp_path_factory):
    s = LlamaServer(smollm2, [], n_ctx=N_CTX, log_path=tmp_path_factory.mktemp("srv") / "plain.log")
    yield s
    s.close()


@pytest.fixture(scope="module")
def eagle(smollm2, smollm2_trained_draft, tmp_path_factory):
    s = LlamaServer(smollm2, ["-md", str(smollm2_trained_draft), *EAGLE2_ARGS, "--metrics"], n_ctx=N_CTX, n_parallel=2,
                    log_path=tmp_path_factory.mktemp("srv") / "eagle2.log")
    yield s
    s.close()


def client(server) -> "openai.OpenAI":
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


# Every request evaluates its whole prompt (no prompt cache): then a request is computed the same way
# each time, and a divergence seen through the openai client can be examined token by token.
NO_CACHE = {"extra_body": {"cache_prompt": False}}


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def tokens_of(server, prompt: str, **kw) -> tuple[list[int], dict]:
    _, r = post(server, "/completion", {"prompt": prompt, "n_predict": N_TOKENS, "temperature": 0.0,
                                        "cache_prompt": False, "return_tokens": True, **kw})
    return r["tokens"], r


def test_greedy_completions_match_the_server_without_speculation(plain, eagle):
    drafted = accepted = 0
    for p in PROMPTS:
        want, _ = tokens_of(plain, p)
        got, r = tokens_of(eagle, p)
        assert got == want, p
        drafted += r["timings"]["draft_n"]
        accepted += r["timings"]["draft_n_accepted"]
    # timings as upstream names them; accepted tree nodes took the path that commits them
    assert drafted > 0 and 0 < accepted <= drafted


def test_openai_completions_and_chat_streaming_or_not(plain, eagle):
    for p in PROMPTS[:3]:
        kw = dict(model="m", prompt=p, max_tokens=N_TOKENS, temperature=0, **NO_CACHE)
        want = client(plain).completions.create(**kw).choices[0].text
        got = client(eagle).completions.create(**kw).choices[0].text
        streamed = "".join(c.choices[0].text for c in client(eagle).completions.create(**kw, stream=True))
        assert got == streamed == want, p
    kw = dict(model="m", messages=[{"role": "user", "content": "Name three colors."}], max_tokens=N_TOKENS,
              temperature=0, **NO_CACHE)
    want = client(plain).chat.completions.create(**kw)
    got = client(eagle).chat.completions.create(**kw)
    chunks = list(client(eagle).chat.completions.create(**kw, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert got.choices[0].message.content == want.choices[0].message.content == streamed
    assert got.usage.completion_tokens == want.usage.completion_tokens


def test_seeded_sampling_draws_what_the_target_alone_draws(plain, eagle):
    """The tree walk samples each emitted token once, from the target's own distribution with the
    slot's sampler chain, as plain decoding does: the same seed draws the same text, also where the
    draft's guesses were accepted."""
    accepted = 0
    for seed in range(1, 9):
        kw = dict(prompt="Once upon a time", n_predict=N_TOKENS, temperature=0.9, top_p=0.95, seed=seed,
                  cache_prompt=False, return_tokens=True)
        want = post(plain, "/completion", kw)[1]["tokens"]
        _, r = post(eagle, "/completion", kw)
        assert r["tokens"] == want, f"seed {seed}"
        accepted += r["timings"]["draft_n_accepted"]
    assert accepted > 0


def test_concurrent_clients_get_the_sequential_answers(eagle):
    """Two slots verify their trees in the same decodes without seeing each other's."""
    sequential = {p: tokens_of(eagle, p)[0] for p in PROMPTS[:4]}
    concurrent = {}

    def run(p):
        concurrent[p] = tokens_of(eagle, p)[0]

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS[:4]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert concurrent == sequential


def test_a_client_that_disconnects_mid_stream_leaves_a_working_slot(eagle):
    want, _ = tokens_of(eagle, PROMPTS[0])
    for _ in range(2):  # both slots
        stream = client(eagle).completions.create(model="m", prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                                  stream=True)
        next(iter(stream))
        stream.close()
    assert tokens_of(eagle, PROMPTS[0])[0] == want


def test_bad_requests_get_an_error_and_the_server_stays_up(eagle):
    # upstream answers malformed JSON with 500 and a parse error, with or without speculation
    status, r = post(eagle, "/completion", b'{"prompt": "hi", "n_predict": ')
    assert status >= 400 and "parse error" in r["error"]["message"]
    status, _ = post(eagle, "/completion", {"prompt": "hi", "n_predict": -5})
    assert 400 <= status < 500
    status, r = post(eagle, "/completion", {"prompt": "hello " * N_CTX, "n_predict": 4})
    assert 400 <= status < 500 and "error" in r
    with pytest.raises(openai.BadRequestError):
        client(eagle).completions.create(model="m", prompt="hi", max_tokens=4, temperature="hot")
    with urllib.request.urlopen(eagle.url + "/health", timeout=10) as r:
        assert r.status == 200
    assert tokens_of(eagle, PROMPTS[2])[0]


def test_metrics_count_drafts_and_acceptance_per_position(eagle):
    tokens_of(eagle, PROMPTS[2])
    with urllib.request.urlopen(eagle.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {}
    per_pos = 0.0
    for line in text.splitlines():
        if line.startswith("llamacpp:spec_decode_num_accepted_tokens_per_pos_total{"):
            per_pos += float(line.rsplit(" ", 1)[1])
        elif line.startswith("llamacpp:spec_decode"):
            name, value = line.split(" ")
            values[name] = float(value)
    drafts = values["llamacpp:spec_decode_num_drafts_total"]
    drafted = values["llamacpp:spec_decode_num_draft_tokens_total"]
    accepted = values["llamacpp:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafted >= drafts and 0 <= accepted <= drafted
    assert per_pos == accepted


def test_the_python_engine_and_the_server_agree(smollm2, smollm2_trained_draft, eagle):
    from eagle_llamacpp.engine import EagleLlama, Sampling

    llm = EagleLlama(smollm2, smollm2_trained_draft, n_ctx=N_CTX, n_threads=2, tree=(4, 2, 2))
    try:
        for p in PROMPTS[:3]:
            got = list(llm.generate(llm.tokenize(p), N_TOKENS, Sampling(temperature=0.0)))
            assert got == tokens_of(eagle, p)[0], p
    finally:
        llm.close()


@pytest.mark.parametrize("head", ["trained", "untrained"])
def test_auto_tree_is_lossless_and_drafts_only_when_it_pays(head, smollm2, smollm2_trained_draft, smollm2_draft,
                                                            plain, tmp_path):
    """--spec-eagle2-auto (the default) measures the verify cost per tree size at start-up, then drafts
    only when the draft's probabilities promise more tokens per ms than plain decoding, at most
    --spec-draft-n-max nodes. An untrained head's drafts almost never do (a random head is confident at
    random, rarely, and its first drafts are trusted until acceptance calibrates them): it decodes as
    the plain server, drafting in a few rounds at most (a fixed tree would draft 6 nodes every round)."""
    draft = smollm2_trained_draft if head == "trained" else smollm2_draft
    s = LlamaServer(smollm2, ["-md", str(draft), *EAGLE2_ARGS, "--spec-eagle2-auto"], n_ctx=N_CTX,
                    log_path=tmp_path / "auto.log")
    try:
        drafted = 0
        rounds_per_request = []
        for p in PROMPTS[:3]:
            got, r = tokens_of(s, p)
            assert got == tokens_of(plain, p)[0], p
            drafted += r["timings"].get("draft_n", 0)
            rounds_per_request.append(len(got) - 1 - r["timings"].get("draft_n_accepted", 0))
        rounds = sum(rounds_per_request)
        assert drafted <= 6 * rounds
        if head == "untrained":
            assert drafted <= 6 * max(2, rounds // 20), (drafted, rounds)
    finally:
        s.close()
    log = (tmp_path / "auto.log").read_text()
    assert "draft-eagle2 auto: verifying  1 tokens takes" in log and "verifying  7 tokens takes" in log
    # each verify (one slot: each target decode after a draft) refines the start-up table, which stays
    # non-decreasing in the tree size; the table is logged as each generation begins
    tables = re.findall(r"verify ms per tree size \((\d+) decodes timed\):((?: \d+: [\d.]+)+)", log)
    timed = [int(n) for n, _ in tables]
    assert len(timed) == 3 and timed[0] == 0
    assert timed[1] >= rounds_per_request[0] // 2 > 0 and timed[2] >= timed[1] + rounds_per_request[1] // 2
    costs = [float(v) for v in re.findall(r"\d+: ([\d.]+)", tables[-1][1])]
    assert len(costs) == 7 and costs[0] > 0 and costs == sorted(costs)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_server_ends_when_the_process_that_started_it_is_killed(smollm2):
    """An out-of-memory kill of a benchmark must not leave its servers holding their models' memory."""
    code = ("import sys, time; from pathlib import Path; from eagle_llamacpp.llama_server import LlamaServer; "
            "s = LlamaServer(Path(sys.argv[1]), [], n_ctx=256); print(s.proc.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(smollm2)], stdout=subprocess.PIPE, text=True)
    server_pid = None
    try:
        server_pid = int(parent.stdout.readline())
        assert _alive(server_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(server_pid)
    finally:
        parent.kill()
        if server_pid is not None and _alive(server_pid):
            os.kill(server_pid, signal.SIGKILL)
