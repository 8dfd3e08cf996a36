"""The EAGLE-1/2 head as a PyTorch module, for training. Parameter names are the official
checkpoint's, so its state_dict saves straight into the HF layout that convert_eagle.py reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    n_head: int
    n_head_kv: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    qkv_bias: bool  # Qwen2 targets have q/k/v biases; the head follows its target

    @classmethod
    def from_target(cls, target_gguf: Path) -> HeadConfig:
        import gguf

        f = gguf.GGUFReader(target_gguf).fields
        arch = f["general.architecture"].contents()

        def get(key, default=None):
            fld = f.get(f"{arch}.{key}")
            return fld.contents() if fld is not None else default

        return cls(int(get("embedding_length")), int(get("feed_forward_length")), int(get("attention.head_count")),
                   int(get("attention.head_count_kv", get("attention.head_count"))),
                   float(get("attention.layer_norm_rms_epsilon", 1e-6)), float(get("rope.freq_base", 10000.0)),
                   len(f["tokenizer.ggml.tokens"].data), arch == "qwen2")

    def hf_config(self) -> dict:
        cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": self.hidden_size,
               "intermediate_size": self.intermediate_size, "num_attention_heads": self.n_head,
               "num_key_value_heads": self.n_head_kv, "num_hidden_layers": 1, "rms_norm_eps": self.rms_norm_eps,
               "rope_theta": self.rope_theta, "vocab_size": self.vocab_size, "hidden_act": "silu",
               "max_position_embeddings": 2048, "bias": True, "torch_dtype": "float16"}
        if self.qkv_bias:
            cfg["qkv_bias"] = True
        return cfg


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.n_head, self.n_head_kv = c.n_head, c.n_head_kv
        self.head_dim = c.hidden_size // c.n_head
        self.q_proj = nn.Linear(c.hidden_size, c.n_head * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.n_head_kv * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.n_head_kv * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.n_head * self.head_dim, c.hidden_size, bias=False)
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # HF "rotate half" rotation, as in the official head
        ang = pos[:, None].float() * self.inv_freq[None, :]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device)
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_head_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_head_kv, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = self.n_head // self.n_head_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Layer(nn.Module):
    """The head's only decoder layer: no input_layernorm (the official heads have none)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)

    def forward(self, x):
        x = x + self.self_attn(x)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHeadNet(nn.Module):
    """predicted f[j+1] = head(embedding(x[j+1]), f[j]) over a whole sequence at draft positions 0.."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([_Layer(c)])

    def forward(self, tok_emb: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.layers[0](self.fc(torch.cat([tok_emb, feats], -1)))

    def save_hf(self, folder: Path) -> Path:
        """config.json + model.safetensors (float16) in the official EAGLE-1/2 layout."""
        import json

        from safetensors.numpy import save_file

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.hf_config(), indent=2) + "\n")
        tensors = {k: np.ascontiguousarray(v.detach().cpu().float().numpy().astype(np.float16))
                   for k, v in self.state_dict().items()}
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
