"""A verify batch must give one-token decoding's logits bit for bit: greedy EAGLE output equals the
target's own only if a near-tie rounds the same way in both.

On the CPU, ggml hands matrix products of 2 or more rows to llamafile's sgemm and a single row to its
own dot product; for F16 matrices (an F16 model's weights, the K/V cache without flash attention)
the two summed in another order. Patch 0006 sends a single F16 row through sgemm too. On AMX CPUs
(repacked weights) a batch of 2-8 rows runs the avx512-vnni kernels that one row runs (patch 0008;
the Q8_0, Q4_K and Q6_K ones take the rows in one call, each row summed in the single-row order,
patch 0010; 5-8 rows ran AMX tiles, which round as those kernels do, before patch 0015); F16
weights, which the AMX path took until patch 0023, take llamafile's sgemm there too. Q5_0 matrices
are repacked as Q8_0 there (patch 0009). Elsewhere, Q8_0 and Q5_0 products of 1-8 rows on AVX512-VNNI take patch 0016's row kernel,
one token as well as a batch, which sums each row as ggml's single-row dot product does, and F16
batches of 2-3 rows take 8-row tiles (patch 0019; a row sums in the same order in any tile), and on
AVX2 and AVX512 batches of 2-8 rows (with AMX, one row too: patch 0023) take each thread's rows in
order with the next tile prefetched (patch 0022: which thread sums a row, and when, changes no sum). CPU
flash attention split a single row's KV cells across threads once the cache view held 512 cells
(past 256 tokens), summing that row in another order than a batch gets; patch 0011 leaves that
split out.
"""

import numpy as np
import pytest

from eagle_llamacpp import _native as nat
from eagle_llamacpp.draft import TargetModel
from tiny_models import N_VOCAB, write_target


@pytest.fixture(scope="module")
def f16_target(tiny_dir):
    path = tiny_dir / "target-llama-f16.gguf"
    write_target(path, "llama", f16=True, seed=5)
    return path


def assert_chains_verify_exactly(path, flash_attn, n_prefix=21, **kw):
    model = TargetModel(path, n_ctx=n_prefix + 64, n_batch=max(32, n_prefix), flash_attn=flash_attn, **kw)
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, model.n_vocab, n_prefix)
    chain = rng.integers(3, model.n_vocab, 9)
    model.decode(prefix, np.arange(len(prefix)))
    one_by_one = []
    for i, token in enumerate(chain):
        model.decode([token], [len(prefix) + i])
        one_by_one.append(model.logits(0).copy())
    for n in range(2, 9):  # the CPU trees the engine verifies (up to 7 tokens) and llama-server's 8
        for start in (0, 1):
            nat.seq_rm(model.ctx, 0, len(prefix))
            if start:  # the verify's root sits after a committed token, as after a round
                model.decode(chain[:start], len(prefix) + np.arange(start))
            tokens = chain[start:start + n]
            model.decode(tokens, len(prefix) + start + np.arange(n), tree=(np.arange(n), np.arange(n) - 1))
            for j in range(n):
                got, want = model.logits(j), one_by_one[start + j]
                assert np.array_equal(got, want), (n, start, j, float(np.max(np.abs(got - want))))
            model.tree_commit([])
    model.close()


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa-on", "fa-off"])
def test_chain_verify_equals_one_token_decoding_on_f16_weights(f16_target, flash_attn):
    assert_chains_verify_exactly(f16_target, flash_attn)


def test_chain_verify_equals_one_token_decoding_past_256_tokens(f16_target):
    assert_chains_verify_exactly(f16_target, flash_attn=True, n_prefix=300)


def test_chain_verify_equals_one_token_decoding_on_smollm2(smollm2):
    """A real quantized model (Q4_1), with weight repacking as set (on by default, as in llama.cpp)."""
    assert_chains_verify_exactly(smollm2, flash_attn=True)


@pytest.fixture(scope="module")
def q5_0_target(tiny_dir):
    path = tiny_dir / "target-qwen2-q5_0.gguf"
    # rows of 8-16 blocks: a kernel that sums a row's blocks otherwise than one-token decoding shows
    write_target(path, "qwen2", n_embd=256, n_ff=512, n_head_kv=2, quant="Q5_0", seed=6)
    return path


def test_chain_verify_equals_one_token_decoding_on_q5_0_weights(q5_0_target):
    assert_chains_verify_exactly(q5_0_target, flash_attn=True)


def test_chain_verify_equals_one_token_decoding_on_q8_0_weights(tiny_dir):
    """Q8_0: a Q4_K_M GGUF's output matrix when its rows can't take K-quants (Qwen2.5-0.5B)."""
    path = tiny_dir / "target-qwen2-q8_0.gguf"
    write_target(path, "qwen2", n_embd=256, n_ff=512, n_head_kv=2, quant="Q8_0", seed=7)
    assert_chains_verify_exactly(path, flash_attn=True)


def test_repacked_q5_0_weights_give_the_logits_of_unrepacked_ones(q5_0_target):
    """Repacking widens Q5_0 to Q8_0 exactly: only the summation order may differ."""
    tokens = np.random.default_rng(1).integers(3, N_VOCAB, 12)
    logits = {}
    for repack in (False, True):
        model = TargetModel(q5_0_target, n_ctx=64, n_batch=16, repack=repack)
        model.decode(tokens, np.arange(len(tokens)))
        logits[repack] = model.logits(len(tokens) - 1).copy()
        model.close()
    assert np.abs(logits[False]).max() > 0.1
    np.testing.assert_allclose(logits[True], logits[False], rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def q4_k_m_target(tiny_dir):
    """A tiny target quantized by llama.cpp to Q4_K_M (Q4_K and Q6_K matrices, rows of 256)."""
    import ctypes

    import llama_cpp

    src = tiny_dir / "target-qwen2-f32-256.gguf"
    write_target(src, "qwen2", n_embd=256, n_ff=512, n_head_kv=2, seed=8)
    dest = tiny_dir / "target-qwen2-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params)) == 0
    return dest


@pytest.mark.parametrize("repack", [True, False], ids=["repacked", "not-repacked"])
def test_chain_verify_equals_one_token_decoding_on_k_quants(q4_k_m_target, repack):
    """Q4_K weights repacked for AVX2 ran gemm for 4 rows and more, K-quants not repacked the tiled
    kernels from 8 rows: patch 0017 keeps verify batches of up to 8 rows on the one-row kernels, and
    patches 0018 and 0020 take up to 8 rows of Q6_K and of repacked Q4_K in passes that sum each row
    as the one-row kernel does."""
    import gguf

    types = {t.tensor_type.name for t in gguf.GGUFReader(q4_k_m_target).tensors}
    assert {"Q4_K", "Q6_K"} <= types, types
    assert_chains_verify_exactly(q4_k_m_target, flash_attn=True, repack=repack)


def test_features_of_k_quants_not_repacked_match_repacked_ones(q4_k_m_target):
    """Training decodes its batches without repacking on AVX512-VNNI CPUs lacking AMX
    (_native.batch_repack): the tiled kernels and the repacked gemm then give the same features and
    logits up to rounding, so the head learns the target it drafts for."""
    tokens = np.random.default_rng(2).integers(3, N_VOCAB, 64)  # past the tiled kernels' 8 rows
    out = {}
    for repack in (False, True):
        model = TargetModel(q4_k_m_target, n_ctx=128, n_batch=64, repack=repack)  # exports features
        model.decode(tokens, np.arange(len(tokens)), outputs=np.ones(len(tokens), np.int8))
        out[repack] = (nat.feature_rows(model.ctx, np.arange(len(tokens)), model.n_embd).copy(),
                       model.logits(len(tokens) - 1).copy())
        model.close()
    for got, want in zip(out[False], out[True]):
        scale = float(np.abs(want).max())
        assert scale > 0.1
        assert float(np.abs(got - want).max()) < 0.05 * scale  # 1 % here: rounding


def test_batch_work_repacks_unless_the_cpu_has_avx512_vnni_without_amx(monkeypatch):
    monkeypatch.delenv("EAGLE_LLAMACPP_REPACK", raising=False)
    avx2 = "CPU : AVX = 1 | AVX2 = 1 | FMA = 1 | REPACK = 1 | "
    vnni = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | REPACK = 1 | "
    amx = "CPU : AVX2 = 1 | AVX512 = 1 | AVX512_VNNI = 1 | AMX_INT8 = 1 | REPACK = 1 | "
    assert nat.batch_repack(avx2) and nat.batch_repack(amx)
    assert not nat.batch_repack(vnni)
    assert nat.batch_repack() == nat.batch_repack(nat.llama_cpp.llama_print_system_info().decode())
    for value, want in (("0", False), ("1", True)):
        monkeypatch.setenv("EAGLE_LLAMACPP_REPACK", value)
        assert [nat.batch_repack(info) for info in (avx2, vnni, amx)] == [want] * 3
