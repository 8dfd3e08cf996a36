"""Untrained EAGLE-1/2 heads in the official HF layout: for tests, and for running the pipeline
before a head has been trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def make_head(hidden=64, inter=96, n_head=4, n_head_kv=4, *, fc_bias=True, qkv_bias=False,
              embed=False, seed=1, vocab=320) -> tuple[dict, dict]:
    """Random EAGLE-1/2 head: (config, tensors with official names)."""
    rng = np.random.default_rng(seed)
    hd = hidden // n_head

    def t(*shape, scale=None):
        scale = scale if scale is not None else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    p = "layers.0."
    ts = {
        "fc.weight": t(hidden, 2 * hidden),
        p + "self_attn.q_proj.weight": t(n_head * hd, hidden),
        p + "self_attn.k_proj.weight": t(n_head_kv * hd, hidden),
        p + "self_attn.v_proj.weight": t(n_head_kv * hd, hidden),
        p + "self_attn.o_proj.weight": t(hidden, n_head * hd),
        p + "mlp.gate_proj.weight": t(inter, hidden),
        p + "mlp.up_proj.weight": t(inter, hidden),
        p + "mlp.down_proj.weight": t(hidden, inter),
        p + "post_attention_layernorm.weight": (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32),
    }
    if fc_bias:
        ts["fc.bias"] = t(hidden, scale=0.1)
    if qkv_bias:
        for k, n in (("q", n_head), ("k", n_head_kv), ("v", n_head_kv)):
            ts[p + f"self_attn.{k}_proj.bias"] = t(n * hd, scale=0.1)
    if embed:
        ts["embed_tokens.weight"] = t(vocab, hidden, scale=1.0)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": hidden, "intermediate_size": inter,
        "num_attention_heads": n_head, "num_key_value_heads": n_head_kv, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab, "hidden_act": "silu",
        "max_position_embeddings": 2048, "bias": fc_bias,
    }
    if qkv_bias:
        cfg["qkv_bias"] = True
    return cfg, ts


def save_head(folder: Path, cfg: dict, tensors: dict, fmt: str = "safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    elif fmt == "bin":
        import torch
        torch.save({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                   folder / "pytorch_model.bin")
    else:
        raise ValueError(fmt)
    return folder


def head_for_target(target_gguf: Path, folder: Path, seed: int = 0) -> Path:
    """An untrained head of the target's shape, saved in the official layout under folder."""
    import gguf

    f = gguf.GGUFReader(target_gguf).fields
    arch = f["general.architecture"].contents()
    cfg, ts = make_head(hidden=int(f[f"{arch}.embedding_length"].contents()),
                        inter=int(f[f"{arch}.feed_forward_length"].contents()),
                        n_head=int(f[f"{arch}.attention.head_count"].contents()),
                        n_head_kv=int(f[f"{arch}.attention.head_count_kv"].contents()),
                        vocab=len(f["tokenizer.ggml.tokens"].data), seed=seed)
    return save_head(folder, cfg, ts)
