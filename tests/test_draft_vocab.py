"""The draft vocabulary inside the draft GGUF (d2t plus the draft's own lm_head rows, copied from the
target's): its logits, its load-time checks, and that the output does not change."""

import json
import shutil

import gguf
import numpy as np
import pytest

from eagle_llamacpp import _native as nat
from eagle_llamacpp import convert as convert_module
from eagle_llamacpp.convert import ConvertError, TargetInfo, convert, default_draft_vocab, read_target
from eagle_llamacpp.draft import EagleDraft, TargetModel
from eagle_llamacpp.gguf_tensors import copy_metadata

# Max |restricted - full| / max |full| over the draft vocabulary, per outtype of the head. The rows are
# bit copies of the target's and the head's layer is the same in both files, so only the lm_head
# matmul's blocking over fewer rows tells the two apart: measured 4.8e-7 absolute (about 1e-7
# relative) for every outtype on the tiny f32 target.
TOLERANCE = {"f32": 1e-6, "f16": 1e-6, "q8_0": 1e-6}


def with_vocab(head: str, tmp_path, ids) -> str:
    """A copy of a head folder that lists `ids` as its tokens by frequency."""
    folder = tmp_path / "head-with-vocab"
    shutil.copytree(head, folder)
    (folder / "draft_vocab.json").write_text(json.dumps([int(i) for i in ids]))
    return folder


def run(draft_path, target_path, n=9, seed=1):
    rng = np.random.default_rng(seed)
    t = TargetModel(target_path, n_ctx=256, n_threads=1)
    d = EagleDraft(draft_path, t, n_ctx=256, n_threads=1)
    tokens, feats = rng.integers(3, 300, n), rng.standard_normal((n, d.n_embd)).astype(np.float32)
    logits, hidden = d.run(tokens, feats, np.arange(n))
    raw = nat.logits_rows(d.ctx, np.arange(n), d.n_vocab)  # the whole rows, as llama.cpp hands them out
    ids = d.vocab_ids
    d.close()
    t.close()
    return logits, hidden, raw, ids


@pytest.mark.parametrize("outtype", ["f32", "f16", "q8_0"])
def test_restricted_logits_equal_the_full_heads_rows(outtype, head_folder, targets, tmp_path):
    target = targets["qwen2"][0]
    ids = np.random.default_rng(0).permutation(320)[:50]
    head = with_vocab(head_folder("qwen2")[0], tmp_path, ids)
    full = convert(head, tmp_path / "full.gguf", target=target, outtype=outtype, draft_vocab=0)
    part = convert(head, tmp_path / "part.gguf", target=target, outtype=outtype, draft_vocab=50)
    lf, hf, _, no_ids = run(full, target)
    lp, hp, raw, part_ids = run(part, target)
    assert no_ids is None and np.array_equal(part_ids, ids)
    assert lp.shape == (9, 50)
    assert np.array_equal(hf, hp)
    assert np.abs(lp - lf[:, ids]).max() <= TOLERANCE[outtype] * np.abs(lf).max()
    others = np.setdiff1d(np.arange(320), ids)
    assert np.all(raw[:, others] == -np.inf) and np.array_equal(raw[:, ids], lp)


def test_quantized_tied_target_rows_are_copied_bit_for_bit(smollm2, tmp_path):
    """SmolLM2 (tied embeddings, token_embd in q8_0): the draft's lm_head rows are the target's
    token_embd rows, in their own quantization."""
    from eagle_llamacpp.random_head import head_for_target

    ids = np.random.default_rng(1).permutation(49152)[:512]
    head = with_vocab(head_for_target(smollm2, tmp_path / "h"), tmp_path, ids)
    part = convert(head, tmp_path / "part.gguf", target=smollm2, draft_vocab=512)
    by_name = {t.name: t for t in gguf.GGUFReader(part).tensors}
    emb = next(t for t in gguf.GGUFReader(smollm2).tensors if t.name == "token_embd.weight")
    assert by_name["output.weight"].tensor_type == emb.tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert np.array_equal(np.asarray(by_name["output.weight"].data), np.asarray(emb.data)[ids])
    assert np.array_equal(np.asarray(by_name["d2t"].data), ids)
    full = convert(head, tmp_path / "full.gguf", target=smollm2, draft_vocab=0)
    lf, _, _, _ = run(full, smollm2)
    lp, _, _, _ = run(part, smollm2)
    assert np.abs(lp - lf[:, ids]).max() <= 1e-6 * np.abs(lf).max()


def test_default_and_bad_sizes(head_folder, targets, tmp_path):
    target = targets["llama"][0]
    plain_head = head_folder("llama")[0]
    # a head without a token list converts with the whole vocabulary, and cannot be restricted
    assert "d2t" not in {t.name for t in gguf.GGUFReader(convert(plain_head, tmp_path / "a.gguf", target=target)).tensors}
    with pytest.raises(ConvertError, match="has no draft_vocab.json"):
        convert(plain_head, tmp_path / "b.gguf", target=target, draft_vocab=10)
    head = with_vocab(plain_head, tmp_path, range(3, 63))
    with pytest.raises(ConvertError, match="lists only 60 tokens"):
        convert(head, tmp_path / "c.gguf", target=target, draft_vocab=61)
    with pytest.raises(ConvertError, match=">= 0"):
        convert(head, tmp_path / "d.gguf", target=target, draft_vocab=-1)
    (head / "draft_vocab.json").write_text(json.dumps([5, 6, 100000]))
    with pytest.raises(ConvertError, match="within the target"):
        convert(head, tmp_path / "e.gguf", target=target, draft_vocab=2)


def test_the_default_size_follows_the_targets_weight_bytes():
    """The largest size whose lm_head rows weigh at most 1% of the target's weights; the smallest
    size when none does, or when the sizes are unknown (a target given as an HF folder)."""
    def target(weight_mb):  # 100,000 tokens, rows of 1,000 bytes
        return TargetInfo("qwen2", 64, 100_000, weight_bytes=weight_mb * 10**6, lm_head_bytes=10**8)

    # 4096 rows (4.096 MB) need 409.6 MB of weights
    assert [default_draft_vocab(target(mb)) for mb in (100, 409, 410, 819, 820, 1700, 9000)] == \
        [2048, 2048, 4096, 4096, 8192, 16384, 16384]
    assert default_draft_vocab(TargetInfo("qwen2", 64, 100_000)) == 2048


def test_read_target_counts_the_weight_bytes(smollm2):
    info = read_target(smollm2)
    tensors = gguf.GGUFReader(smollm2).tensors
    assert info.weight_bytes == sum(int(t.n_bytes) for t in tensors)
    # tied embeddings: the lm_head is token_embd, 49,152 rows of q8_0
    assert info.lm_head_bytes == next(int(t.n_bytes) for t in tensors if t.name == "token_embd.weight")
    assert default_draft_vocab(info) == 2048  # 2048 rows are 1.3% of its 97 MB: the smallest size


@pytest.mark.parametrize("share,expected", [(1.0, 64), (1e-6, 16)])
def test_convert_sizes_the_default_vocabulary_by_the_rule(share, expected, head_folder, targets, tmp_path,
                                                         monkeypatch):
    """draft_vocab=None converts with default_draft_vocab's size (sizes scaled to the tiny target)."""
    target = targets["llama"][0]
    monkeypatch.setattr(convert_module, "DRAFT_VOCAB_SIZES", (16, 32, 64))
    monkeypatch.setattr(convert_module, "DRAFT_LM_HEAD_SHARE", share)
    head = with_vocab(head_folder("llama")[0], tmp_path, range(3, 303))
    out = convert(head, tmp_path / "default.gguf", target=target)
    d2t = next(t for t in gguf.GGUFReader(out).tensors if t.name == "d2t")
    assert np.array_equal(np.asarray(d2t.data), np.arange(3, 3 + expected))


def rewrite_d2t(src, dst, change) -> None:
    """dst = src with its d2t tensor passed through change()."""
    from eagle_llamacpp.convert import _add_raw

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer)
    for t in reader.tensors:
        if t.name == "d2t":
            writer.add_tensor("d2t", change(np.array(t.data, dtype=np.int64)))
        else:
            _add_raw(writer, t.name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("change,message", [
    (lambda d: np.where(np.arange(len(d)) == 3, 320 + 7, d), "entry 3 is token 327, outside the vocabulary of 320"),
    (lambda d: np.where(np.arange(len(d)) == 4, d[0], d), "appears twice"),
])
def test_a_bad_draft_vocabulary_is_refused_at_load(change, message, head_folder, targets, tmp_path):
    target = targets["llama"][0]
    head = with_vocab(head_folder("llama")[0], tmp_path, range(3, 43))
    good = convert(head, tmp_path / "good.gguf", target=target, draft_vocab=40)
    bad = tmp_path / "bad.gguf"
    rewrite_d2t(good, bad, change)
    t = TargetModel(target, n_ctx=256, n_threads=1)
    with pytest.raises(nat.EagleError, match=message):
        EagleDraft(bad, t, n_ctx=256, n_threads=1)
    assert EagleDraft(good, t, n_ctx=256, n_threads=1).n_draft_vocab == 40  # and the target is still fine
    t.close()
