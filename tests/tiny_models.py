"""Tiny random llama/qwen2 target GGUFs and EAGLE-1/2 heads in the official layout, made offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle_llamacpp.random_head import make_head, save_head  # noqa: F401 (re-exported for tests)

N_VOCAB = 320


def _vocab():
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581w{i}" for i in range(N_VOCAB - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (N_VOCAB - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(N_VOCAB - 259)]
    return tokens, scores, types


def write_target(path: Path, arch: str, *, n_embd=64, n_layer=2, n_head=4, n_head_kv=4, n_ff=128,
                 seed=0, tied=False, name=None, chat_template=None, f16=False, quant=None) -> dict:
    """Writes a random target GGUF (f32; with f16, its matrices in f16 as in an F16 GGUF, norms and
    biases f32; with quant "Q5_0" or "Q8_0", its matrices in that type, the ones a Q4_K_M GGUF gives
    rows K-quants can't split) and returns its tensors (numpy order; quantized ones as written) for
    reference checks."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name or f"tiny-{arch}")
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_block_count(n_layer)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(1 if f16 else 0)
    tokens, scores, types = _vocab()
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if chat_template:
        w.add_chat_template(chat_template)

    def t(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hd = n_embd // n_head
    out = {"token_embd.weight": t(N_VOCAB, n_embd, scale=1.0)}
    if not tied:
        out["output.weight"] = t(N_VOCAB, n_embd)
    out["output_norm.weight"] = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
    for i in range(n_layer):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        out[p + "attn_q.weight"] = t(n_head * hd, n_embd)
        out[p + "attn_k.weight"] = t(n_head_kv * hd, n_embd)
        out[p + "attn_v.weight"] = t(n_head_kv * hd, n_embd)
        if arch == "qwen2":
            out[p + "attn_q.bias"] = t(n_head * hd, scale=0.1)
            out[p + "attn_k.bias"] = t(n_head_kv * hd, scale=0.1)
            out[p + "attn_v.bias"] = t(n_head_kv * hd, scale=0.1)
        if arch == "qwen3":
            out[p + "attn_q_norm.weight"] = np.ones(hd, np.float32)
            out[p + "attn_k_norm.weight"] = np.ones(hd, np.float32)
        out[p + "attn_output.weight"] = t(n_embd, n_head * hd)
        out[p + "ffn_norm.weight"] = (1 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32)
        out[p + "ffn_gate.weight"] = t(n_ff, n_embd)
        out[p + "ffn_up.weight"] = t(n_ff, n_embd)
        out[p + "ffn_down.weight"] = t(n_embd, n_ff)
    if f16:
        out = {name: arr.astype(np.float16) if arr.ndim == 2 else arr for name, arr in out.items()}
    for name, arr in out.items():
        if quant and arr.ndim == 2:
            qtype = gguf.GGMLQuantizationType[quant]
            out[name] = arr = gguf.quants.quantize(arr, qtype)
            w.add_tensor(name, arr, raw_dtype=qtype)
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
