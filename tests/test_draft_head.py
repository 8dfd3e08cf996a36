"""The eagle2 architecture in the patched llama.cpp against the PyTorch reference head."""

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from reference_eagle import head_forward
from tiny_models import write_target

from eagle_llamacpp import _native as nat
from eagle_llamacpp.convert import TENSOR_MAP, convert
from eagle_llamacpp.draft import EagleDraft, TargetModel

# Max |llama.cpp - reference| / max |reference| per outtype. The reference uses the weights as
# stored in the GGUF (dequantized), so what is left is llama.cpp's arithmetic. Even with f32
# weights llama.cpp stores K and V in its f16 KV cache (measured ~2e-4); with f16/bf16 weights
# the CPU matmul also rounds activations to f16/bf16; with q8_0 weights it quantizes activations
# to 8 bits per block of 32.
TOLERANCE = {"f32": 1e-3, "f16": 5e-3, "bf16": 2e-2, "q8_0": 3e-2}

GGUF_TO_OFFICIAL = {v: k for k, v in TENSOR_MAP.items()}


def weights_as_stored(path):
    out = {}
    for t in gguf.GGUFReader(path).tensors:
        arr = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[GGUF_TO_OFFICIAL[t.name]] = arr.reshape([int(x) for x in reversed(t.shape.tolist())])
    return out


def run_head(draft_path, target_path, n=12, seed=3, flash_attn=False):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 320, n)
    target = TargetModel(target_path, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    feats = rng.standard_normal((n, target.n_embd)).astype(np.float32)
    draft = EagleDraft(draft_path, target, n_ctx=256, n_batch=64, flash_attn=flash_attn)
    pos = np.arange(n)
    # two calls: the second attends to the first one's KV cells
    l1, h1 = draft.forward(tokens[:5], feats[:5], pos[:5])
    l2, h2 = draft.forward(tokens[5:], feats[5:], pos[5:])
    return tokens, feats, pos, np.concatenate([l1, l2]), np.concatenate([h1, h2])


def rel_err(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("style,fmt", [("llama", "safetensors"), ("qwen2", "bin")])
@pytest.mark.parametrize("outtype", ["f32", "f16", "bf16", "q8_0"])
def test_logits_and_hidden_match_reference(style, fmt, outtype, head_folder, targets, tmp_path):
    folder, cfg, _ = head_folder(style, fmt)
    target_path, target_ts = targets[style]
    draft_path = convert(folder, tmp_path / "d.gguf", target=target_path, outtype=outtype)
    tokens, feats, pos, logits, hidden = run_head(draft_path, target_path)
    ref_logits, ref_hidden = head_forward(weights_as_stored(draft_path), cfg, target_ts["token_embd.weight"],
                                          target_ts["output.weight"], tokens, feats, pos)
    assert rel_err(hidden, ref_hidden) < TOLERANCE[outtype]
    assert rel_err(logits, ref_logits) < TOLERANCE[outtype]


@pytest.mark.parametrize("flash_attn", [False, True])
def test_flash_attention_on_and_off(flash_attn, head_folder, targets, tmp_path):
    folder, cfg, ts = head_folder("qwen2")
    target_path, target_ts = targets["qwen2"]
    draft_path = convert(folder, tmp_path / "d.gguf", target=target_path, outtype="f32")
    tokens, feats, pos, logits, hidden = run_head(draft_path, target_path, flash_attn=flash_attn)
    ref_logits, ref_hidden = head_forward(ts, cfg, target_ts["token_embd.weight"], target_ts["output.weight"],
                                          tokens, feats, pos)
    # flash attention on the CPU accumulates V in f16
    tol = 5e-3 if flash_attn else 1e-3
    assert rel_err(hidden, ref_hidden) < tol
    assert rel_err(logits, ref_logits) < tol


def test_embedded_target_head_loads_and_matches(head_folder, targets, tmp_path):
    """A draft GGUF that carries its own token_embd and lm_head (as the seed PR wrote them)."""
    folder, cfg, ts = head_folder("llama")
    target_path, target_ts = targets["llama"]
    draft_path = convert(folder, tmp_path / "d.gguf", target=target_path, outtype="f32", embed_target_head=True)
    tokens, feats, pos, logits, hidden = run_head(draft_path, target_path)
    ref_logits, _ = head_forward(ts, cfg, target_ts["token_embd.weight"], target_ts["output.weight"],
                                 tokens, feats, pos)
    assert rel_err(logits, ref_logits) < 1e-3


def test_tied_target_lends_its_embedding_as_lm_head(head_folder, tiny_dir, tmp_path):
    target_path = tmp_path / "tied.gguf"
    target_ts = write_target(target_path, "llama", tied=True, seed=5)
    folder, cfg, ts = head_folder("llama")
    draft_path = convert(folder, tmp_path / "d.gguf", target=target_path, outtype="f32")
    tokens, feats, pos, logits, _ = run_head(draft_path, target_path)
    ref_logits, _ = head_forward(ts, cfg, target_ts["token_embd.weight"], target_ts["token_embd.weight"],
                                 tokens, feats, pos)
    assert rel_err(logits, ref_logits) < 1e-3


def test_draft_for_another_target_fails_at_load(head_folder, targets, tmp_path):
    folder, _, _ = head_folder("llama")
    draft_path = convert(folder, tmp_path / "d.gguf", target=targets["llama"][0], outtype="f32")
    small = tmp_path / "small.gguf"
    write_target(small, "llama", n_embd=32, n_head=4, n_head_kv=4, n_ff=64)
    target = TargetModel(small, n_ctx=128, n_batch=32)
    with pytest.raises(nat.EagleError, match="hidden size 64 does not match the target's 32"):
        EagleDraft(draft_path, target, n_ctx=128, n_batch=32)


def test_vocabulary_mismatch_fails_at_load(head_folder, targets, tmp_path):
    import tiny_models
    folder, _, _ = head_folder("llama")
    draft_path = convert(folder, tmp_path / "d.gguf", target=targets["llama"][0], outtype="f32")
    other = tmp_path / "other-vocab.gguf"
    old = tiny_models.N_VOCAB
    tiny_models.N_VOCAB = 300
    try:
        write_target(other, "llama")
    finally:
        tiny_models.N_VOCAB = old
    target = TargetModel(other, n_ctx=128, n_batch=32)
    with pytest.raises(nat.EagleError, match="vocabulary size 320 does not match the target's 300"):
        EagleDraft(draft_path, target, n_ctx=128, n_batch=32)


def test_non_draft_gguf_is_rejected(targets):
    target = TargetModel(targets["llama"][0], n_ctx=128, n_batch=32)
    with pytest.raises(nat.EagleError, match="not an EAGLE-1/2 draft"):
        EagleDraft(targets["qwen2"][0], target)


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(nat.EagleError, match="cannot load model"):
        TargetModel(bad)
    with pytest.raises(nat.EagleError, match="no such file"):
        TargetModel(tmp_path / "missing.gguf")


def test_target_exports_final_hidden_state_for_every_token(targets):
    """Patch 0002: the llama/qwen2 graphs export the post-norm hidden state of every batch token."""
    for arch in ("llama", "qwen2"):
        target = TargetModel(targets[arch][0], n_ctx=128, n_batch=32)
        toks = [5, 9, 33, 17, 80]
        out = np.zeros(len(toks), np.int8)
        out[-1] = 1  # logits for the last token only
        target.decode(toks, np.arange(len(toks)), outputs=out)
        feats = np.stack([target.feature(i) for i in range(len(toks))])
        # the last row must reproduce the last token's logits through lm_head
        lm = targets[arch][1]["output.weight"]
        np.testing.assert_allclose(feats[-1] @ lm.T, target.logits(len(toks) - 1), rtol=1e-4, atol=1e-4)
        # and rows differ per token (not one repeated or zero row)
        assert np.all(np.abs(feats).sum(1) > 0) and len({r.tobytes() for r in feats}) == len(toks)


def test_target_of_another_family_fails_at_load(head_folder, targets, tmp_path):
    folder, _, _ = head_folder("llama")
    draft_path = convert(folder, tmp_path / "d.gguf", target=targets["llama"][0], outtype="f32")
    qwen3 = tmp_path / "qwen3.gguf"
    write_target(qwen3, "qwen3")  # same hidden size and vocabulary, another family
    target = TargetModel(qwen3, n_ctx=128, n_batch=32)
    with pytest.raises(nat.EagleError, match="target architecture 'qwen3' is not supported"):
        EagleDraft(draft_path, target, n_ctx=128, n_batch=32)


def test_unpatched_library_is_detected():
    import ctypes

    nat.check_patched(nat.lib)  # the library in use is ours
    other = ctypes.CDLL(str(nat.library_dir() / "libggml-base.so"))  # any library without our symbols
    with pytest.raises(nat.EagleError, match="unpatched libllama"):
        nat.check_patched(other)


def test_library_folder_supplies_ggml_too(tmp_path):
    """EAGLE_LLAMACPP_LIB pointing at a copy of a build (another build's libraries, as benchmarks
    compare them) loads that folder's ggml, not the one libllama's RUNPATH names."""
    import shutil
    import subprocess
    import sys

    for path in nat.library_dir().iterdir():
        if path.name.startswith(("libllama.so", "libggml")):
            shutil.copy(path, tmp_path / path.name, follow_symlinks=True)
    code = ("import eagle_llamacpp._native; "
            "print('\\n'.join(line.split()[-1] for line in open('/proc/self/maps') if 'libggml' in line))")
    env = dict(os.environ, EAGLE_LLAMACPP_LIB=str(tmp_path))
    env.pop("LD_LIBRARY_PATH", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    loaded = {Path(p).resolve().parent for p in r.stdout.split()}
    assert loaded == {tmp_path.resolve()}, loaded


def test_library_folder_with_a_broken_ggml_is_a_clear_error(tmp_path):
    import shutil
    import subprocess
    import sys

    shutil.copy(nat.library_dir() / "libllama.so", tmp_path / "libllama.so", follow_symlinks=True)
    (tmp_path / "libggml-base.so").write_bytes(b"not a library")
    env = dict(os.environ, EAGLE_LLAMACPP_LIB=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", "import eagle_llamacpp._native"], capture_output=True, text=True,
                       env=env)
    assert r.returncode != 0
    assert f"EagleError: cannot load {tmp_path / 'libggml-base.so'}" in r.stderr
