"""Training a head (features from the patched llama.cpp, the torch head, resumable training, the
HF output) and the draft vocabulary it records, on tiny random targets."""

import json

import numpy as np
import pytest

from eagle_llamacpp.convert import convert
from eagle_llamacpp.draft import EagleDraft, TargetModel
from eagle_llamacpp.features import ChatRenderer, FeatureShard, extract
from tiny_models import write_target

torch = pytest.importorskip("torch")

from eagle_llamacpp.head_model import EagleHeadNet, HeadConfig  # noqa: E402
from eagle_llamacpp.train import TrainConfig, target_tensors, train  # noqa: E402

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
    from eagle_llamacpp import features

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
