"""Training a head (features from the patched llama.cpp, the torch head, resumable training, the
HF output) and the draft vocabulary it records, on tiny random targets."""

import json

import numpy as np
import pytest

from eagle_llamacpp.convert import convert
from eagle_llamacpp.draft import EagleDraft, TargetModel
from eagle_llamacpp.chat import ChatRenderer
from eagle_llamacpp.training.features import FeatureShard, extract
from tiny_models import write_target

torch = pytest.importorskip("torch")

from eagle_llamacpp.training.head_model import EagleHeadNet, HeadConfig  # noqa: E402
from eagle_llamacpp.training.train import TrainConfig, target_tensors, train  # noqa: E402

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def conversations(n, seed=0):
    rng = np.random.default_rng(seed)

    def words(k):
        return " ".join(f"w{i}" for i in rng.integers(3, 60, k))

    return [[{"role": "user", "content": words(6)}, {"role": "assistant", "content": words(int(rng.integers(8, 20)))},
             {"role": "user", "content": words(4)}, {"role": "assistant", "content": words(10)}] for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def chat_target(request, tiny_dir):
    path = tiny_dir / f"chat-target-{request.param}.gguf"
    if not path.exists():
        write_target(path, request.param, n_head_kv=2 if request.param == "qwen2" else 4, chat_template=TEMPLATE)
    return path


@pytest.fixture(scope="module")
def shards(chat_target, tmp_path_factory):
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    out = tmp_path_factory.mktemp("features")
    paths = extract(t, conversations(24), out, max_tokens=96, token_budget=10_000, shard_tokens=300, progress=False)
    t.close()
    return paths


def test_renderer_marks_exactly_the_assistant_replies(chat_target):
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    r = ChatRenderer(t)
    conv = conversations(1, seed=3)[0]
    tokens, mask = r.tokens_and_mask(conv, 1000)
    # turn-by-turn tokenization is the whole conversation's tokenization
    assert list(tokens) == t.tokenize(r.render(conv, False), add_special=True)
    # the tiny vocabulary's word pieces start with U+2581, which piece() returns undecoded
    replied = "".join(t.piece(int(x)) for x, m in zip(tokens, mask) if m).replace("\ufffd", " ")
    assert replied.split() == " ".join(m["content"] for m in conv if m["role"] == "assistant").split()
    assert r.prompt_tokens(conv[:1]) == t.tokenize(r.render(conv[:1], True), add_special=True)
    t.close()


def packing_target(chat_target):
    """Room for several conversations per decode, as `train` extracts them."""
    return TargetModel(chat_target, n_ctx=256, n_batch=256, n_seq_max=8, n_threads=1)


def test_extraction_resumes_where_it_stopped(chat_target, shards, tmp_path, monkeypatch):
    from eagle_llamacpp.training import features

    batch_sizes = []
    packed_features = features.packed_features
    monkeypatch.setattr(features, "packed_features",
                        lambda t, seqs: batch_sizes.append(len(seqs)) or packed_features(t, seqs))
    t = packing_target(chat_target)
    convs = conversations(24)
    extract(t, convs, tmp_path, max_tokens=96, token_budget=600, shard_tokens=300, progress=False)
    first = json.loads((tmp_path / "manifest.json").read_text())
    assert 600 <= first["n_tokens"] < 10_000
    resumed = extract(t, convs, tmp_path, max_tokens=96, token_budget=10_000, shard_tokens=300, progress=False)
    fresh = extract(t, convs, tmp_path / "fresh", max_tokens=96, token_budget=10_000, shard_tokens=300,
                    progress=False)
    t.close()
    a = [FeatureShard.load(p) for p in resumed]
    f = [FeatureShard.load(p) for p in fresh]
    b = [FeatureShard.load(p) for p in shards]
    assert np.array_equal(np.concatenate([s.tokens for s in a]), np.concatenate([s.tokens for s in b]))
    # a resumed run decodes the batches a fresh one does
    assert np.array_equal(np.concatenate([s.feats for s in a]), np.concatenate([s.feats for s in f]))
    # several conversations per decode (their own sequences) give each one's features alone
    assert max(batch_sizes) > 1
    packed, alone = np.concatenate([s.feats for s in a]), np.concatenate([s.feats for s in b])
    assert np.abs(packed.astype(np.float32) - alone).max() <= 1e-3 * np.abs(alone).max()
    # features are the target's final hidden state, as the engine reads it
    s = b[0]
    tokens, feats, _ = next(s.sequences())
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    t.decode(tokens, np.arange(len(tokens)), outputs=np.zeros(len(tokens), np.int8))
    ref = np.stack([t.feature(i) for i in range(len(tokens))])
    t.close()
    assert np.abs(ref - feats.astype(np.float32)).max() <= 2e-3 * np.abs(ref).max()


def test_torch_head_is_the_head_llamacpp_runs(chat_target, tmp_path):
    """The trained module and the eagle2 graph compute the same function, so training transfers."""
    cfg = HeadConfig.from_target(chat_target)
    torch.manual_seed(0)
    net = EagleHeadNet(cfg)
    with torch.no_grad():  # non-trivial norm weights and biases
        for name, p in net.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    head = net.save_hf(tmp_path / "head")
    draft_path = convert(head, tmp_path / "d.gguf", target=chat_target, outtype="f32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 300, 12).astype(np.int32)
    feats = rng.standard_normal((12, cfg.hidden_size)).astype(np.float32)
    emb, _ = target_tensors(chat_target)
    with torch.no_grad():
        ref = net(torch.from_numpy(emb[tokens])[None], torch.from_numpy(feats)[None])[0].numpy()
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    d = EagleDraft(draft_path, t, n_ctx=256, n_threads=1)
    _, hidden = d.run(tokens, feats, np.arange(12))
    d.close()
    t.close()
    # the saved safetensors are float16, so allow for that rounding
    assert np.abs(hidden - ref).max() <= 1e-2 * np.abs(ref).max()


def test_training_learns_and_resumes_exactly(chat_target, shards, tmp_path):
    cfg = TrainConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, draft_vocab=64, save_every=1000)
    extraction = {"tokens": 1234, "seconds": 5.0, "tokens_per_s": 246.8}
    head = train(chat_target, shards, tmp_path / "a", cfg, n_threads=1, progress=False,
                 card_extra={"features": extraction})
    card = json.loads((head / "training.json").read_text())
    assert card["eval"]["vloss"] < 0.8 * card["eval_before"]["vloss"]
    assert card["steps"] > 3
    assert card["features"] == extraction and card["tokens_per_s"] > 0
    assert sorted(p.name for p in head.iterdir()) == ["config.json", "draft_vocab.json", "model.safetensors",
                                                      "training.json"]

    assert train(chat_target, shards, tmp_path / "b", cfg, n_threads=1, progress=False, stop_after=3) is None
    resumed = train(chat_target, shards, tmp_path / "b", cfg, n_threads=1, progress=False)
    from safetensors.numpy import load_file
    a, b = load_file(str(head / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k]) for k in a)

    # the draft vocabulary: most frequent reply tokens first, recorded in the GGUF
    vocab = json.loads((head / "draft_vocab.json").read_text())
    replies = np.concatenate([s.tokens[s.mask.astype(bool)] for s in map(FeatureShard.load, shards)])
    counts = np.bincount(replies, minlength=320)
    assert len(vocab) == 64 and np.all(np.diff(counts[vocab]) <= 0)
    assert counts[vocab[-1]] >= np.sort(counts)[::-1][63]


def test_bf16_training_learns_as_float32_does(chat_target, shards, tmp_path):
    """--bf16: the same run under bfloat16 autocast ends within a few percent of float32's held-out
    loss (the 0.5B's head, 120k tokens: held-out top-1 0.4684 against 0.4687, 2.5x the tokens/s)."""
    from dataclasses import replace

    cfg = TrainConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, draft_vocab=64, save_every=1000)
    cards = {}
    for bf16 in (False, True):
        head = train(chat_target, shards, tmp_path / str(bf16), replace(cfg, bf16=bf16), n_threads=1, progress=False)
        cards[bf16] = json.loads((head / "training.json").read_text())
    assert cards[True]["config"]["bf16"] and not cards[False]["config"]["bf16"]
    assert cards[True]["eval"]["vloss"] < 0.8 * cards[True]["eval_before"]["vloss"]
    assert abs(cards[True]["eval"]["vloss"] - cards[False]["eval"]["vloss"]) < 0.05 * cards[False]["eval"]["vloss"]


def test_llamacpp_decodes_after_bf16_training_in_one_process(tmp_path):
    """PyTorch's bfloat16 kernels (oneDNN) release a thread's AMX tiles when they finish; ggml's AMX
    kernels had loaded the tile configuration once per thread, so a batch decode after bf16
    training in the same process died of an illegal instruction (patch 0013; on CPUs without AMX
    neither side uses tiles). Run in a child process, so that a fault fails this test alone."""
    import subprocess
    import sys
    from pathlib import Path

    from tiny_models import write_target

    model = tmp_path / "q5_0.gguf"
    write_target(model, "qwen2", n_head_kv=2, quant="Q5_0")  # Q5_0: repacked for the AMX kernels
    script = f"""
import numpy as np, torch
from eagle_llamacpp import _native as nat
from eagle_llamacpp.draft import TargetModel
t = TargetModel({str(model)!r}, n_ctx=256, n_threads=2)
x = torch.randn(256, 256)
for _ in range(3):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (x @ x).sum()
    nat.clear_memory(t.ctx)
    t.decode(np.arange(32), np.arange(32), outputs=np.zeros(32, np.int8))  # 32 rows: AMX tiles
t.close()
print("decoded")
"""
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=120)
    assert res.returncode == 0 and "decoded" in res.stdout, res.stderr[-2000:]


@pytest.fixture(scope="module")
def trained_draft(chat_target, shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    head = train(chat_target, shards, out, TrainConfig(epochs=2, batch_size=4, lr=2e-3, warmup_steps=2,
                                                        draft_vocab=80), n_threads=1, progress=False)
    return head, convert(head, out / "d.gguf", target=chat_target, outtype="f32")


def test_restricted_draft_vocab_keeps_greedy_output(chat_target, trained_draft, tmp_path):
    from eagle_llamacpp.bench import plain_greedy
    from eagle_llamacpp.engine import EagleLlama, Sampling

    head, _ = trained_draft
    prompt = [1] + list(np.random.default_rng(2).integers(3, 300, 20))
    outs = []
    for dv in (0, 40):
        draft = convert(head, tmp_path / f"d{dv}.gguf", target=chat_target, outtype="f32", draft_vocab=dv)
        llm = EagleLlama(chat_target, draft, n_ctx=256, n_threads=1, tree=(6, 3, 2))
        assert llm.draft.n_draft_vocab == (40 if dv else 320)
        outs.append(list(llm.generate(prompt, 40, Sampling(temperature=0.0))))
        if dv == 0:
            plain, _ = plain_greedy(llm, prompt, 40)
        llm.close()
    assert outs[0] == outs[1] == plain


def distill_target(chat_target):
    """Four reply slots, each in its own KV stream, as `train --self-distill` runs them."""
    return TargetModel(chat_target, n_ctx=4 * 96, n_batch=128, n_seq_max=4, n_threads=1, kv_unified=False)


@pytest.fixture(scope="module")
def distilled(chat_target, tmp_path_factory):
    from eagle_llamacpp.training.distill import generate

    t = distill_target(chat_target)
    out = tmp_path_factory.mktemp("distill")
    paths = generate(t, conversations(24), out, max_tokens=96, token_budget=10_000, shard_tokens=150, progress=False)
    t.close()
    return paths


def greedy_continuation(t, prompt, n_tokens):
    """Plain greedy decoding, one sequence: the tokens and the last token's feature."""
    from eagle_llamacpp import _native as nat

    nat.clear_memory(t.ctx)
    out = list(prompt)
    t.decode(np.asarray(out), np.arange(len(out)))
    last = len(out) - 1
    while len(out) < n_tokens:
        out.append(int(np.argmax(t.logits(last))))
        t.decode(np.asarray(out[-1:]), np.asarray([len(out) - 1]))
        last = 0
    return out, t.feature(last)


def test_self_distilled_replies_are_the_targets_greedy_replies(chat_target, distilled):
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    prompts = [tuple(ChatRenderer(t).prompt_tokens(c[:1])) for c in conversations(24)]
    seqs = [seq for p in distilled for seq in FeatureShard.load(p).sequences()]
    assert len(seqs) == 24 and len(distilled) > 1
    for tokens, feats, mask in seqs:
        n_prompt = int(np.argmax(mask))
        assert tuple(tokens[:n_prompt]) in prompts and mask[n_prompt:].all() and len(tokens) > n_prompt
        # the reply is what the target alone writes greedily from that prompt, and the features are
        # the target's hidden states (checked on the last token, decoded after all the others)
        ref_tokens, ref_feat = greedy_continuation(t, tokens[:n_prompt], len(tokens))
        assert ref_tokens == list(tokens)
        assert np.abs(ref_feat - feats[-1].astype(np.float32)).max() <= 2e-3 * np.abs(ref_feat).max()
    t.close()


def test_self_distillation_resumes_with_the_same_replies(chat_target, distilled, tmp_path):
    from eagle_llamacpp.training.distill import generate

    t = distill_target(chat_target)
    first = generate(t, conversations(24), tmp_path, max_tokens=96, token_budget=200, shard_tokens=150,
                     progress=False)
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert 200 <= manifest["n_tokens"] < 10_000 and manifest["in_flight"]
    resumed = generate(t, conversations(24), tmp_path, max_tokens=96, token_budget=10_000, shard_tokens=150,
                       progress=False)
    t.close()
    assert resumed[:len(first)] == first

    def replies(paths):
        return sorted(tuple(s[0]) for p in paths for s in FeatureShard.load(p).sequences())

    # every conversation exactly once, and the same reply as an uninterrupted run
    assert replies(resumed) == replies(distilled)


def interrupt_at_decode(monkeypatch, target, n):
    """Sends this process SIGINT (Ctrl-C) as the target's n-th decode returns."""
    import os
    import signal

    decode, calls = target.decode, []

    def counted(*args, **kwargs):
        out = decode(*args, **kwargs)
        calls.append(1)
        if len(calls) == n:
            os.kill(os.getpid(), signal.SIGINT)
        return out

    monkeypatch.setattr(target, "decode", counted)


def stop_then_resume(monkeypatch, target, at_decode, produce, folder):
    """produce() stopped by Ctrl-C as the target's at_decode-th decode returns, then run again to its
    end: the folder's manifest after the stop, and the shards of the finished run."""
    interrupt_at_decode(monkeypatch, target, at_decode)
    with pytest.raises(KeyboardInterrupt):
        produce()
    manifest = json.loads((folder / "manifest.json").read_text())
    monkeypatch.undo()
    return manifest, produce()


def test_ctrl_c_keeps_the_finished_replies(chat_target, distilled, tmp_path, monkeypatch):
    """Ctrl-C while replies are made: the decode under way ends, every finished reply is written (the
    shard is far from full, so without the flush none would be), KeyboardInterrupt follows, and the
    same call goes on to the replies of an uninterrupted run."""
    from eagle_llamacpp.training.distill import generate

    t = distill_target(chat_target)
    manifest, resumed = stop_then_resume(
        monkeypatch, t, 60, lambda: generate(t, conversations(24), tmp_path, max_tokens=96, token_budget=10_000,
                                             shard_tokens=10_000, progress=False), tmp_path)
    t.close()
    kept = [tuple(s[0]) for name in manifest["shards"] for s in FeatureShard.load(tmp_path / name).sequences()]
    every = {tuple(s[0]) for p in distilled for s in FeatureShard.load(p).sequences()}
    assert 0 < len(kept) < 24 and set(kept) <= every and manifest["in_flight"]
    assert manifest["n_tokens"] == sum(map(len, kept))
    assert sorted(tuple(s[0]) for p in resumed for s in FeatureShard.load(p).sequences()) == sorted(every)


def test_ctrl_c_stops_extraction_at_a_batch_boundary(chat_target, shards, tmp_path, monkeypatch):
    """Ctrl-C during feature extraction writes the batches decoded so far and resumes at the next one."""
    t = packing_target(chat_target)
    manifest, resumed = stop_then_resume(
        monkeypatch, t, 2, lambda: extract(t, conversations(24), tmp_path, max_tokens=96, token_budget=10_000,
                                           shard_tokens=10_000, progress=False), tmp_path)
    t.close()
    assert manifest["shards"] and 0 < manifest["n_conv"] < 24
    assert np.array_equal(np.concatenate([FeatureShard.load(p).tokens for p in resumed]),
                          np.concatenate([FeatureShard.load(p).tokens for p in shards]))


def test_train_says_where_an_interrupted_folder_stands(chat_target, distilled, tmp_path, monkeypatch, capsys):
    from eagle_llamacpp import cli, data
    from eagle_llamacpp.training import distill

    monkeypatch.setattr(data, "training_conversations", lambda: conversations(24))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distill, "generate", interrupted)
    with pytest.raises(SystemExit) as stop:
        cli.make_features(make_features_args(self_distill=True, tokens=100), chat_target, distilled[0].parent)
    n_tokens = json.loads((distilled[0].parent / "manifest.json").read_text())["n_tokens"]
    assert stop.value.code == 130
    assert f"holds {n_tokens} tokens; the same command goes on" in capsys.readouterr().err


def test_distill_seqs_sets_the_reply_slots_and_keeps_the_replies(chat_target, distilled, tmp_path):
    """`train --distill-seqs 7`: seven replies per decode instead of the fixture's four, the same replies."""
    from eagle_llamacpp import _native as nat
    from eagle_llamacpp import cli
    from eagle_llamacpp.training.distill import generate

    t = cli.extraction_target(make_features_args(distill_seqs=7), chat_target, streams=True)
    assert nat.llama_cpp.llama_n_seq_max(t.ctx) == 7 and nat.llama_cpp.llama_n_ctx(t.ctx) >= 7 * 96
    paths = generate(t, conversations(24), tmp_path, max_tokens=96, token_budget=10_000, shard_tokens=150,
                     progress=False)
    t.close()
    seqs = sorted(tuple(s[0]) for p in paths for s in FeatureShard.load(p).sequences())
    assert len(seqs) == 24 and seqs == sorted(tuple(s[0]) for p in distilled for s in FeatureShard.load(p).sequences())
    with pytest.raises(SystemExit, match="give at least 1 reply per decode"):
        cli.main(["train", "-m", str(chat_target), "-o", str(tmp_path / "none"), "--self-distill", "--distill-seqs", "0"])


def test_multi_step_training_on_self_distilled_features(chat_target, distilled, tmp_path):
    cfg = TrainConfig(epochs=3, batch_size=4, lr=2e-3, warmup_steps=2, draft_vocab=64, steps=3, save_every=1000)
    head = train(chat_target, distilled, tmp_path / "a", cfg, n_threads=1, progress=False)
    card = json.loads((head / "training.json").read_text())
    assert card["config"]["steps"] == 3
    assert card["eval"]["vloss"] < 0.8 * card["eval_before"]["vloss"]
    # held-out top-1 at each chained step, the first being eval.top1
    assert len(card["eval"]["top1_per_step"]) == 3 and card["eval"]["top1_per_step"][0] == card["eval"]["top1"]
    # interrupted and resumed, multi-step training ends with the same weights
    assert train(chat_target, distilled, tmp_path / "b", cfg, n_threads=1, progress=False, stop_after=2) is None
    resumed = train(chat_target, distilled, tmp_path / "b", cfg, n_threads=1, progress=False)
    from safetensors.numpy import load_file
    a, b = load_file(str(head / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_multi_step_training_lowers_the_later_steps_loss(chat_target, distilled, tmp_path):
    """Training steps 2..3 on the head's own features: those steps' held-out feature loss falls
    below a head trained on step 1 alone (same data, seed, epochs)."""
    cards = []
    for steps in (1, 3):
        cfg = TrainConfig(epochs=4, batch_size=4, lr=2e-3, warmup_steps=2, draft_vocab=64, steps=steps, seed=1)
        head = train(chat_target, distilled, tmp_path / f"s{steps}", cfg, n_threads=1, progress=False)
        cards.append(json.loads((head / "training.json").read_text())["eval"])
    assert "vloss_per_step" in cards[1]
    assert cards[1]["vloss_per_step"][2] < cards[0]["vloss_per_step"][2]


def test_multi_step_head_is_the_chain_llamacpp_drafts(chat_target, tmp_path):
    """Step s of the training-time test computes what the eagle2 graph computes for a depth-s
    draft node: the committed prefix with the target's features, then nodes fed the head's own."""
    cfg = HeadConfig.from_target(chat_target)
    torch.manual_seed(1)
    net = EagleHeadNet(cfg)
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    draft_path = convert(net.save_hf(tmp_path / "head"), tmp_path / "d.gguf", target=chat_target, outtype="f32")
    rng = np.random.default_rng(1)
    tokens = rng.integers(3, 300, 12).astype(np.int32)
    feats = rng.standard_normal((12, cfg.hidden_size)).astype(np.float32)
    emb, _ = target_tensors(chat_target)
    with torch.no_grad():
        preds = [p[0].numpy() for p in net.forward_steps(torch.from_numpy(emb[tokens])[None],
                                                          torch.from_numpy(feats)[None], 3)]
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    d = EagleDraft(draft_path, t, n_ctx=256, n_threads=1)
    for j in (0, 4, 8):
        d.clear()
        _, hidden = d.run(tokens[:j + 1], feats[:j + 1], np.arange(j + 1))
        own = hidden[j]
        for s in (1, 2):  # the chain's next nodes, each fed the node before's prediction
            _, h = d.run(tokens[j + s:j + s + 1], own[None], np.asarray([j + s]))
            own = h[0]
            ref = preds[s][j]
            assert np.abs(own - ref).max() <= 1e-2 * np.abs(ref).max()
        assert np.abs(hidden[j] - preds[0][j]).max() <= 1e-2 * np.abs(preds[0][j]).max()
    d.close()
    t.close()


def test_train_uses_only_the_tokens_asked_for(shards):
    from eagle_llamacpp.cli import first_tokens

    sizes = [int(FeatureShard.load(p).offsets[-1]) for p in shards]
    assert first_tokens(shards, 1) == shards[:1]
    assert first_tokens(shards, sizes[0] + 1) == shards[:2]
    assert first_tokens(shards, sum(sizes) * 2) == shards


def test_skip_tokens_trains_on_a_folders_new_part(shards):
    """--skip-tokens N: the shards past the first ones holding N tokens (a head trained on the
    folder's start goes on with what it grew by), and the count skipped for the card."""
    from eagle_llamacpp.cli import shards_after

    sizes = [int(FeatureShard.load(p).offsets[-1]) for p in shards]
    assert shards_after(shards, 0) == (shards, 0)
    assert shards_after(shards, sizes[0]) == (shards[1:], sizes[0])
    assert shards_after(shards, sizes[0] + 1) == (shards[2:], sizes[0] + sizes[1])
    assert shards_after(shards, sum(sizes)) == ([], sum(sizes))


def test_init_from_a_llama_target_undoes_its_rope_row_order():
    """llama GGUFs store q/k rows permuted for ggml's normal rope (convert_hf_to_gguf: per head,
    (2, half) -> (half, 2)); the head rotates halves as HF does, so the copy must undo it."""
    from eagle_llamacpp.training.train import _unpermute_rope_rows

    w = np.random.default_rng(0).standard_normal((4 * 16, 8))
    converted = w.reshape(4, 2, 8, 8).swapaxes(1, 2).reshape(w.shape)
    assert not np.array_equal(converted, w)
    assert np.array_equal(_unpermute_rope_rows(converted, 4), w)


def test_held_out_replies_never_repeat_a_training_reply(shards, tmp_path):
    from eagle_llamacpp.training.features import ShardWriter
    from eagle_llamacpp.training.shards import ShardStream

    # the same replies written twice over, as self-distillation repeats refusals
    writer = ShardWriter(tmp_path, 10**9, {})
    for _ in range(2):
        for tokens, feats, mask in FeatureShard.load(shards[0]).sequences():
            writer.add(tokens, feats, mask)
    writer.flush()
    stream = ShardStream(writer.shard_paths())
    train_idx, eval_idx = stream.split(0.3, 0)
    assert len(eval_idx) >= 2 and len(train_idx) + len(eval_idx) == len(stream)

    def reply(i):
        tokens, _, mask = stream.sequence(int(i))
        return tuple(tokens[mask.astype(bool)])

    assert not {reply(i) for i in eval_idx} & {reply(i) for i in train_idx}


def test_int8_head_reads_back_within_its_blocks_rounding(chat_target, tmp_path):
    from eagle_llamacpp.checkpoint import load_head

    torch.manual_seed(0)
    net = EagleHeadNet(HeadConfig.from_target(chat_target))
    f16 = net.save_hf(tmp_path / "f16")
    q8 = net.save_hf(tmp_path / "q8", int8=True)
    assert (q8 / "model.safetensors").stat().st_size < 0.6 * (f16 / "model.safetensors").stat().st_size
    read = load_head(q8).tensors
    state = {k: v.float().numpy() for k, v in net.state_dict().items()}
    assert sorted(read) == sorted(state)  # scales are folded in, not extra tensors
    for name, w in state.items():
        if w.ndim == 2:  # int8 blocks: an error of at most half a step of the block's scale
            bound = np.abs(w.reshape(w.shape[0], -1, 32)).max(-1, keepdims=True) / 254 * 1.01 + 1e-7
            assert (np.abs(read[name] - w).reshape(bound.shape[0], -1, 32) <= bound).all(), name
        else:  # norms and biases stay float16
            assert np.array_equal(read[name], w.astype(np.float16).astype(np.float32)), name


def test_int8_tensor_without_its_scales_is_a_clear_error(tmp_path):
    from safetensors.numpy import save_file

    from eagle_llamacpp.checkpoint import CheckpointError, read_safetensors

    path = tmp_path / "model.safetensors"
    save_file({"fc.weight": np.ones((4, 64), np.int8)}, str(path))
    with pytest.raises(CheckpointError, match="no fc.weight.scale"):
        read_safetensors(path)
    save_file({"fc.weight": np.ones((4, 64), np.int8), "fc.weight.scale": np.ones((4, 3), np.float16)}, str(path))
    with pytest.raises(CheckpointError, match="does not match its scales"):
        read_safetensors(path)


def test_narrow_head_starts_from_the_targets_strongest_mlp_channels(chat_target, shards, tmp_path):
    from dataclasses import replace

    from eagle_llamacpp.checkpoint import load_head
    from eagle_llamacpp.training.head_model import mlp_channels
    from eagle_llamacpp.training.train import target_last_layer

    layer = target_last_layer(chat_target)
    full = layer["ffn_gate.weight"].shape[0]
    net = EagleHeadNet(replace(HeadConfig.from_target(chat_target), intermediate_size=full // 2))
    net.init_from_target_layer(layer)
    keep = mlp_channels(layer, full // 2)
    score = (np.linalg.norm(layer["ffn_gate.weight"], axis=1) * np.linalg.norm(layer["ffn_up.weight"], axis=1)
             * np.linalg.norm(layer["ffn_down.weight"], axis=0))
    assert score[keep].min() >= np.delete(score, keep).max()
    mlp = net.layers[0].mlp
    assert np.array_equal(mlp.gate_proj.weight.detach().numpy(), layer["ffn_gate.weight"][keep])
    assert np.array_equal(mlp.up_proj.weight.detach().numpy(), layer["ffn_up.weight"][keep])
    assert np.array_equal(mlp.down_proj.weight.detach().numpy(), layer["ffn_down.weight"][:, keep])
    # and through training: the narrow head trains, is stored as int8 and loads at its width
    cfg = TrainConfig(epochs=1, batch_size=4, lr=2e-3, warmup_steps=2, draft_vocab=64, save_every=1000,
                      init_from_target=True, intermediate_size=full // 2, int8=True)
    head = train(chat_target, shards, tmp_path / "narrow", cfg, n_threads=1, progress=False)
    assert load_head(head).intermediate_size == full // 2
    card = json.loads((head / "training.json").read_text())
    assert card["config"]["intermediate_size"] == full // 2 and card["config"]["int8"] is True


def test_training_goes_on_from_a_trained_head(chat_target, shards, trained_draft, tmp_path):
    """--init-from-head: the run starts from the head's weights (its held-out figures before training
    are the head's own, up to float16 storage), and a head made for another shape is refused."""
    head, _ = trained_draft
    before = json.loads((head / "training.json").read_text())["eval"]
    cfg = TrainConfig(epochs=1, batch_size=4, lr=1e-3, warmup_steps=2, draft_vocab=80, init_from_head=str(head))
    went_on = train(chat_target, shards, tmp_path / "more", cfg, n_threads=1, progress=False)
    card = json.loads((went_on / "training.json").read_text())
    assert card["eval_before"]["vloss"] == pytest.approx(before["vloss"], rel=2e-2)
    assert card["eval_before"]["top1"] == pytest.approx(before["top1"], abs=0.05)
    fresh = json.loads((head / "training.json").read_text())["eval_before"]
    assert card["eval_before"]["vloss"] < 0.8 * fresh["vloss"]
    assert card["config"]["init_from_head"] == str(head)
    assert card["started_from"] == json.loads((head / "training.json").read_text())

    from eagle_llamacpp.checkpoint import load_head
    tensors = dict(load_head(head).tensors)
    net = EagleHeadNet(HeadConfig.from_target(chat_target))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-2]
    with pytest.raises(ValueError, match="another target: fc.weight"):
        net.load_head(tensors)
    del tensors["fc.weight"]
    with pytest.raises(ValueError, match="lacks fc.weight"):
        net.load_head(tensors)
    with pytest.raises(ValueError, match="exclude each other"):
        train(chat_target, shards, tmp_path / "both", TrainConfig(init_from_head=str(head), init_from_target=True),
              n_threads=1, progress=False)


def test_new_data_starts_at_the_conversation_asked_for(chat_target, tmp_path):
    """first_conv: a fresh folder skips the conversations an earlier head was trained on."""
    from eagle_llamacpp.training.distill import generate

    convs = conversations(24)
    t = distill_target(chat_target)
    paths = generate(t, convs, tmp_path / "distill", max_tokens=96, token_budget=10_000, first_conv=20,
                     progress=False)
    t.close()
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    renderer = ChatRenderer(t)
    prompts = sorted(tuple(renderer.prompt_tokens(c[:1])) for c in convs[20:])
    seqs = [seq for p in paths for seq in FeatureShard.load(p).sequences()]
    assert sorted(tuple(tokens[:int(np.argmax(mask))]) for tokens, _, mask in seqs) == prompts
    assert json.loads((tmp_path / "distill" / "manifest.json").read_text())["first_conv"] == 20
    paths = extract(t, convs, tmp_path / "features", max_tokens=96, token_budget=10_000, first_conv=20,
                    progress=False)
    expected = [tuple(renderer.tokens_and_mask(c, 96)[0]) for c in convs[20:]]
    t.close()
    assert [tuple(s[0]) for p in paths for s in FeatureShard.load(p).sequences()] == expected


def test_later_user_turns_are_answered_after_the_conversations_own_turns(chat_target, tmp_path, monkeypatch):
    """user_turn 2: the prompt is the first user message, ShareGPT's reply and the second user
    message; conversations without a second user message are skipped, the reply is the target's
    greedy one, and a folder keeps the turn it was made from."""
    from eagle_llamacpp.training.distill import generate

    convs = conversations(8)
    convs[3] = convs[3][:2]  # one user turn only
    # these prompts take 140-200 tokens
    t = TargetModel(chat_target, n_ctx=4 * 256, n_batch=256, n_seq_max=4, n_threads=1, kv_unified=False)
    paths = generate(t, convs, tmp_path / "second", max_tokens=256, token_budget=10_000, user_turn=2,
                     progress=False)
    with pytest.raises(ValueError, match="user turn 2, not 1"):
        generate(t, convs, tmp_path / "second", max_tokens=256, token_budget=10_000, progress=False)
    t.close()
    assert json.loads((tmp_path / "second" / "manifest.json").read_text())["user_turn"] == 2
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    renderer = ChatRenderer(t)
    prompts = sorted(tuple(renderer.prompt_tokens(c[:3])) for i, c in enumerate(convs) if i != 3)
    seqs = [seq for p in paths for seq in FeatureShard.load(p).sequences()]
    assert sorted(tuple(tokens[:int(np.argmax(mask))]) for tokens, _, mask in seqs) == prompts
    tokens, _, mask = seqs[0]
    n_prompt = int(np.argmax(mask))
    assert greedy_continuation(t, tokens[:n_prompt], len(tokens))[0] == list(tokens)
    t.close()
    # `train --features <that folder>` goes on with its turn and says so on the card
    from eagle_llamacpp import cli, data

    monkeypatch.setattr(data, "training_conversations", lambda: convs)
    args = make_features_args(tokens=10)
    _, made = cli.make_features(args, chat_target, tmp_path / "second")
    assert args.user_turn == 2 and "second user turns" in made["data"]


def test_user_turn_needs_self_distillation(chat_target, distilled, tmp_path):
    """--user-turn without --self-distill, or with --tokens-from, is refused; a first-turn folder
    refuses another turn."""
    from eagle_llamacpp import cli

    with pytest.raises(SystemExit, match="give --self-distill"):
        cli.make_features(make_features_args(user_turn=2), chat_target, tmp_path / "f")
    with pytest.raises(SystemExit, match="user turn 1, not 2"):
        cli.make_features(make_features_args(self_distill=True, user_turn=2, tokens=10**6), chat_target,
                          distilled[0].parent)
    with pytest.raises(SystemExit, match="re-encoded features"):  # nothing to answer, so not ignored
        cli.make_features(make_features_args(tokens_from=[str(distilled[0].parent)], user_turn=2), chat_target,
                          tmp_path / "r")


def make_features_args(**given):
    """`train`'s feature options as the CLI parses them, over make_features' tiny test data."""
    import argparse

    return argparse.Namespace(**{**dict(self_distill=False, distill_temp=0.0, distill_seqs=16, max_len=96, threads=1,
                                        tokens=None, seed=0, first_conversation=0, tokens_from=None,
                                        user_turn=None), **given})


def test_a_self_distilled_folder_stays_self_distilled(chat_target, distilled, monkeypatch):
    """`train --features <self-distilled folder>` without --self-distill: the run goes on distilling
    into it (ShareGPT's own replies are never mixed in) and the card says self-distilled."""
    from eagle_llamacpp import cli, data

    monkeypatch.setattr(data, "training_conversations", lambda: conversations(24))
    args = make_features_args(tokens=100)
    shards, made = cli.make_features(args, chat_target, distilled[0].parent)
    assert args.self_distill
    assert made["data"].startswith("self-distilled") and "generated_tokens_per_s" in made
    assert shards == distilled[:len(shards)]


def test_a_features_folder_trains_on_all_it_holds_by_default(chat_target, distilled, monkeypatch):
    """Without --tokens, a --features folder bigger than the default trains on all of it, not on its
    first DEFAULT_TOKENS tokens."""
    from eagle_llamacpp import cli, data

    monkeypatch.setattr(data, "training_conversations", lambda: conversations(24))
    monkeypatch.setattr(cli, "DEFAULT_TOKENS", 10)
    args = make_features_args(self_distill=True)
    shards, made = cli.make_features(args, chat_target, distilled[0].parent)
    assert args.tokens == made["tokens"] > 10
    assert shards == distilled


def test_reencoding_a_folder_gives_the_features_extraction_gave(chat_target, shards, tmp_path):
    """--tokens-from: the sequences of another feature folder (here one this target extracted, in
    the same batches) get exactly the features extraction gave them, and a stopped run resumes."""
    from eagle_llamacpp.training.features import read_manifest, reencode

    source = shards[0].parent
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)  # one conversation per decode, as `shards`
    once = reencode(t, [source], tmp_path / "once", token_budget=10_000, shard_tokens=300, progress=False)
    reencode(t, [source], tmp_path / "resumed", token_budget=600, shard_tokens=300, progress=False)
    stopped_at = read_manifest(tmp_path / "resumed")["n_tokens"]
    resumed = reencode(t, [source], tmp_path / "resumed", token_budget=10_000, shard_tokens=300, progress=False)
    t.close()
    src, a, b = ([FeatureShard.load(p) for p in paths] for paths in (shards, once, resumed))
    for key in ("tokens", "mask", "feats"):
        want = np.concatenate([getattr(s, key) for s in src])
        assert np.array_equal(np.concatenate([getattr(s, key) for s in a]), want)
        assert np.array_equal(np.concatenate([getattr(s, key) for s in b]), want)
    assert 600 <= stopped_at < len(np.concatenate([s.tokens for s in src]))
    assert read_manifest(tmp_path / "once")["tokens_from"] == [str(source)]


def test_reencoding_refuses_another_tokenizers_folder(chat_target, tmp_path):
    from eagle_llamacpp.training.features import ShardWriter, reencode
    from tiny_models import N_VOCAB

    writer = ShardWriter(tmp_path / "other", 100, {})
    writer.add(np.array([1, 2, N_VOCAB + 5, 3]), np.zeros((4, 8)), np.ones(4))
    writer.flush()
    t = TargetModel(chat_target, n_ctx=256, n_threads=1)
    with pytest.raises(ValueError, match="another tokenizer"):
        reencode(t, [tmp_path / "other"], tmp_path / "out", token_budget=100, progress=False)
    with pytest.raises(ValueError, match="not a feature folder"):
        reencode(t, [tmp_path / "missing"], tmp_path / "out", token_budget=100, progress=False)
    t.close()


def test_a_reencoded_folder_resumes_from_its_own_sources(chat_target, distilled, tmp_path):
    """`train --tokens-from DIR` records its sources; a later run on the folder, without the option,
    goes on with them, and the card names them."""
    from eagle_llamacpp import cli

    shards, made = cli.make_features(make_features_args(tokens=300, tokens_from=[str(distilled[0].parent)]),
                                     chat_target, tmp_path / "re")
    assert "re-encoded" in made["data"] and made["data"].startswith("self-distilled")
    assert made["tokens_from"][0]["folder"] == str(distilled[0].parent)
    more, made = cli.make_features(make_features_args(tokens=10_000), chat_target, tmp_path / "re")
    assert more[:len(shards)] == shards and len(more) > len(shards)
    total = sum(len(s.tokens) for s in map(FeatureShard.load, distilled))
    assert made["tokens"] == total


def test_chain_hits_stop_at_the_first_miss_and_at_the_reply_end():
    from eagle_llamacpp.training.agreement import chain_hits, emitted_ahead

    assert emitted_ahead(np.array([5, 6, 7, 8]), 2).tolist() == [[7, 8], [8, -1], [-1, -1]]
    drafted = np.array([[7, 8, 9], [7, 0, 9], [1, 8, 9], [-1, -1, -1]])
    emitted = np.array([[7, 8, 9], [7, 8, 9], [7, 8, 9], [-1, -1, -1]])
    assert chain_hits(drafted, emitted).tolist() == [[True, True, True], [True, False, False],
                                                     [False, False, False], [False, False, False]]


class _OracleNet:
    """Drafts from the target's own next features: what a perfect head would predict."""

    def eval(self):
        pass

    def forward_steps(self, tok_emb, f_in, n_steps):
        import torch.nn.functional as F

        return [F.pad(f_in[:, 1 + s:], (0, 0, 0, 1 + s)) for s in range(n_steps)]


def test_agreement_lines_drafts_up_with_the_tokens_the_target_emitted(chat_target, distilled):
    """On greedy replies the target's next feature drafts the emitted token (so a misaligned
    draft would score near 0), and a smaller vocabulary loses exactly the tokens outside it."""
    from eagle_llamacpp.training.agreement import measure
    from eagle_llamacpp.training.shards import ShardStream

    stream = ShardStream(distilled)
    emb, lm_head = target_tensors(chat_target)
    by_freq = np.argsort(-np.bincount(np.concatenate([t for t, _ in stream.tokens_and_masks()]),
                                      minlength=len(lm_head)), kind="stable")
    r = measure(_OracleNet(), stream, emb, lm_head, by_freq, (len(lm_head), 16), n_steps=2)
    whole, small = r["sizes"][str(len(lm_head))], r["sizes"]["16"]
    assert r["positions"] > 200
    assert whole["emitted_in_vocab"] == 1.0
    assert whole["top1"] >= 0.98 and whole["top1_as_trained"] >= 0.98
    assert 1.9 < whole["chain_acceptance_length"][1] <= 3.0
    assert small["emitted_in_vocab"] < 0.9
    assert abs(small["top1"] - small["emitted_in_vocab"]) <= 0.02
    assert small["top1_as_trained"] >= 0.98


def test_several_feature_folders_train_as_one(shards, distilled, tmp_path):
    """`--features A B`: every shard of both finished folders, in order, and a card that names them;
    a folder with no shards is a clear error, not an empty run."""
    from eagle_llamacpp.cli import several_folders
    from eagle_llamacpp.training.features import read_manifest

    folders = [shards[0].parent, distilled[0].parent]
    got, made = several_folders(folders)
    assert got == list(shards) + list(distilled)
    assert made["tokens"] == sum(read_manifest(f)["n_tokens"] for f in folders)
    assert [f["folder"] for f in made["folders"]] == [str(f) for f in folders]
    assert made["data"] == "ShareGPT and self-distilled features of 2 folders at once"
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no feature shards"):
        several_folders([folders[0], tmp_path / "empty"])
    # several folders are only read: options that would make or extend one are refused, not ignored
    from eagle_llamacpp.cli import main

    base = ["train", "-m", "unused.gguf", "-o", str(tmp_path / "o"), "--features", *map(str, folders)]
    for extra in (["--self-distill"], ["--tokens-from", str(folders[0])], ["--user-turn", "2"]):
        with pytest.raises(SystemExit, match="only read"):
            main(base + extra)
