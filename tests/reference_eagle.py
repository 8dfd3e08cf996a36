"""PyTorch reference of the EAGLE-1/2 head forward pass (official module structure, no llama.cpp)."""

from __future__ import annotations

import numpy as np
import torch


def _rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def _rope(x, pos, theta):
    # x: [n_head, T, d]; HF "rotate half" rotation
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = pos[:, None].to(torch.float64) * inv[None, :]
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def head_forward(ts: dict, cfg: dict, embed: np.ndarray, lm_head: np.ndarray, tokens, feats, pos):
    """Causal forward over one sequence of (token, feature) pairs. Returns (logits, hidden), float64."""
    T = {k: torch.from_numpy(np.asarray(v, dtype=np.float64)) for k, v in ts.items()}
    H = cfg["hidden_size"]
    n_head = cfg["num_attention_heads"]
    d = H // n_head
    n_kv = T["layers.0.self_attn.k_proj.weight"].shape[0] // d
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)

    e = torch.from_numpy(np.asarray(embed, dtype=np.float64))[torch.as_tensor(tokens, dtype=torch.long)]
    h = torch.from_numpy(np.asarray(feats, dtype=np.float64))
    x = torch.cat([e, h], dim=-1) @ T["fc.weight"].T
    if "fc.bias" in T:
        x = x + T["fc.bias"]

    def proj(name):
        y = x @ T[f"layers.0.self_attn.{name}_proj.weight"].T
        b = T.get(f"layers.0.self_attn.{name}_proj.bias")
        return y + b if b is not None else y

    n = x.shape[0]
    q = proj("q").view(n, n_head, d).transpose(0, 1)
    k = proj("k").view(n, n_kv, d).transpose(0, 1)
    v = proj("v").view(n, n_kv, d).transpose(0, 1)
    p = torch.as_tensor(pos, dtype=torch.long)
    q, k = _rope(q, p, theta), _rope(k, p, theta)
    rep = n_head // n_kv
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    att = (q @ k.transpose(-1, -2)) / np.sqrt(d)
    att = att.masked_fill(p[None, :] > p[:, None], float("-inf")).softmax(-1)
    a = (att @ v).transpose(0, 1).reshape(n, n_head * d) @ T["layers.0.self_attn.o_proj.weight"].T
    z = x + a
    m = _rms_norm(z, T["layers.0.post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(m @ T["layers.0.mlp.gate_proj.weight"].T) * (m @ T["layers.0.mlp.up_proj.weight"].T))
    out = z + mlp @ T["layers.0.mlp.down_proj.weight"].T
    logits = out @ torch.from_numpy(np.asarray(lm_head, dtype=np.float64)).T
    return logits.numpy(), out.numpy()
