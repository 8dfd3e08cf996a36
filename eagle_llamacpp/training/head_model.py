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

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """q, k, v as [b, heads, t, head_dim] at positions pos, rotated, k/v repeated to the q heads."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_head_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_head_kv, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, pos), self._rope(k, pos)
        rep = self.n_head // self.n_head_kv
        return q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_step(x, [])

    def forward_step(self, x: torch.Tensor, kv: list) -> torch.Tensor:
        """Step len(kv)+1 of a training-time test: kv holds the (k, v) of the earlier steps. Step 1 is
        causal self-attention at positions 0..t-1. At step s > 1, index j sits at position j+s-1 and
        attends to step 1's keys at indices <= j (the committed prefix and the depth-1 node) and to
        its own index's keys of steps 2..s: a depth-s draft node and its ancestors. Appends this
        step's (k, v) to kv."""
        b, t, _ = x.shape
        step = len(kv)
        q, k, v = self.qkv(x, torch.arange(t, device=x.device) + step)
        kv.append((k, v))
        if step == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scale = self.head_dim ** -0.5
            k0, v0 = kv[0]
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            prefix = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
            own = torch.stack([(q * ki).sum(-1) * scale for ki, _ in kv[1:]], -1)
            w = torch.cat([prefix, own], -1).softmax(-1)
            y = w[..., :t] @ v0 + sum(w[..., t + i, None] * vi for i, (_, vi) in enumerate(kv[1:]))
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

    def forward(self, x, kv: list | None = None):
        x = x + (self.self_attn(x) if kv is None else self.self_attn.forward_step(x, kv))
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

    def forward_steps(self, tok_emb: torch.Tensor, feats: torch.Tensor, n_steps: int) -> list[torch.Tensor]:
        """Predictions of n_steps chained steps (EAGLE-3's training-time test, HASS): step 1 is
        forward(); step s reads step s-1's predicted features with the tokens s-1 further on
        (zero past the end), so index j of step s predicts f[j+s]. Tree levels 2 and deeper
        draft from the head's own features, and this trains them on exactly that."""
        kv: list = []
        preds = []
        x = feats
        for s in range(n_steps):
            tok = tok_emb if s == 0 else F.pad(tok_emb[:, s:], (0, 0, 0, s))
            x = self.layers[0](self.fc(torch.cat([tok, x], -1)), kv)
            preds.append(x)
        return preds

    def init_from_target_layer(self, tensors: dict[str, np.ndarray]) -> None:
        """Copies a target decoder layer (GGUF names without the blk.N. prefix, float32 [out, in])
        into the head's layer; fc keeps its own initialisation. A head with a narrower MLP than the
        target's takes the target's strongest MLP channels (mlp_channels)."""
        names = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                 "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
                 "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
                 "attn_v.bias": "self_attn.v_proj.bias", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
                 "ffn_down.weight": "mlp.down_proj.weight"}
        tensors = dict(tensors)
        if "ffn_gate.weight" in tensors and tensors["ffn_gate.weight"].shape[0] != self.config.intermediate_size:
            keep = mlp_channels(tensors, self.config.intermediate_size)
            for gguf_name in ("ffn_gate.weight", "ffn_up.weight"):
                tensors[gguf_name] = tensors[gguf_name][keep]
            tensors["ffn_down.weight"] = tensors["ffn_down.weight"][:, keep]
        params = dict(self.layers[0].named_parameters())
        with torch.no_grad():
            for gguf_name, name in names.items():
                if name in params and gguf_name in tensors:
                    params[name].copy_(torch.tensor(tensors[gguf_name]).reshape(params[name].shape))

    def load_head(self, tensors: dict[str, np.ndarray]) -> None:
        """Takes a trained head's weights (checkpoint.load_head's float32 tensors, official names) to
        go on training it; the shapes must be this head's."""
        own = self.state_dict()
        missing = sorted(set(own) - set(tensors))
        if missing:
            raise ValueError(f"the head to start from lacks {', '.join(missing)}")
        wrong = [f"{k} {tuple(tensors[k].shape)} (needs {tuple(v.shape)})" for k, v in own.items()
                 if tuple(tensors[k].shape) != tuple(v.shape)]
        if wrong:
            raise ValueError(f"the head to start from was made for another target: {'; '.join(wrong)}")
        self.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(tensors[k], np.float32)) for k in own})

    def save_hf(self, folder: Path, int8: bool = False) -> Path:
        """config.json + model.safetensors in the official EAGLE-1/2 layout: float16, or with
        int8=True its 2-D weights as int8 blocks (checkpoint.int8_blocks, half the size)."""
        import json

        from safetensors.numpy import save_file

        from ..checkpoint import INT8_BLOCK, INT8_SCALE_SUFFIX, int8_blocks

        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(self.config.hf_config(), indent=2) + "\n")
        tensors = {}
        for name, value in self.state_dict().items():
            w = value.detach().cpu().float().numpy()
            if int8 and w.ndim == 2 and w.shape[1] % INT8_BLOCK == 0:
                tensors[name], tensors[name + INT8_SCALE_SUFFIX] = int8_blocks(w)
            else:
                tensors[name] = np.ascontiguousarray(w.astype(np.float16))
        save_file(tensors, str(folder / "model.safetensors"))
        return folder


def mlp_channels(tensors: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The n MLP channels of a target layer that carry the most, by the product of their gate row,
    up row and down column norms (a channel's output scales with all three), in channel order."""
    score = (np.linalg.norm(tensors["ffn_gate.weight"], axis=1) * np.linalg.norm(tensors["ffn_up.weight"], axis=1)
             * np.linalg.norm(tensors["ffn_down.weight"], axis=0))
    if n > score.size:
        raise ValueError(f"the head's MLP ({n}) is wider than the target's ({score.size})")
    return np.sort(np.argsort(-score, kind="stable")[:n])
