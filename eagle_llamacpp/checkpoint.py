"""Reading EAGLE-1/2 draft checkpoints in the official HF layout (config.json + weights)."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class CheckpointError(ValueError):
    """The input is not a readable EAGLE-1/2 checkpoint."""


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8}

# Heads trained here may store 2-D weights as int8 blocks (Q8_0's layout, to keep the repo small):
# tensor NAME (I8, [rows, cols]) and NAME.scale (F16, [rows, cols / 32]); value = int8 x its block's scale.
INT8_BLOCK = 32
INT8_SCALE_SUFFIX = ".scale"


def _bf16_to_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32)


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Minimal safetensors reader (f32/f16/bf16, and int8 blocks with their scales) that reports
    truncation and corruption clearly. Returns float32 arrays."""
    data = path.read_bytes()
    if len(data) < 8:
        raise CheckpointError(f"{path.name}: truncated safetensors file")
    (n_header,) = struct.unpack("<Q", data[:8])
    if n_header > len(data) - 8:
        raise CheckpointError(f"{path.name}: truncated or corrupt safetensors header")
    try:
        header = json.loads(data[8:8 + n_header])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path.name}: corrupt safetensors header ({e})") from None
    base = 8 + n_header
    out = {}
    int8_names = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _ST_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {info.get('dtype')}")
        start, end = info["data_offsets"]
        if base + end > len(data):
            raise CheckpointError(f"{path.name}: truncated (tensor {name} runs past the end of the file)")
        arr = np.frombuffer(data, dtype=dtype, count=(end - start) // np.dtype(dtype).itemsize, offset=base + start)
        arr = _bf16_to_f32(arr) if info["dtype"] == "BF16" else arr.astype(np.float32)
        if arr.size != int(np.prod(info["shape"], dtype=np.int64)):
            raise CheckpointError(f"{path.name}: tensor {name} has {arr.size} values for shape {info['shape']}")
        out[name] = arr.reshape(info["shape"])
        if info["dtype"] == "I8":
            int8_names.append(name)
    for name in int8_names:
        out[name] = _dequantize_int8_blocks(path, name, out[name], out.pop(name + INT8_SCALE_SUFFIX, None))
    return out


def _dequantize_int8_blocks(path: Path, name: str, q: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    if scale is None:
        raise CheckpointError(f"{path.name}: int8 tensor {name} has no {name}{INT8_SCALE_SUFFIX}")
    if q.ndim != 2 or q.shape[1] % INT8_BLOCK or scale.shape != (q.shape[0], q.shape[1] // INT8_BLOCK):
        raise CheckpointError(f"{path.name}: int8 tensor {name} {list(q.shape)} does not match its scales "
                              f"{list(scale.shape)} (one per {INT8_BLOCK} values of a row)")
    return (q.reshape(*scale.shape, INT8_BLOCK) * scale[..., None]).reshape(q.shape)


def int8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [rows, cols] (cols a multiple of 32) as int8 values and float16 scales, one per block of
    32 values of a row, as read_safetensors reads them back. The scales are Q8_0's (max |w| / 127);
    the values are rounded against the float16 scale as stored, where gguf's Q8_0 rounds against
    the float32 one, so that each value is within half a step of what is read back."""
    blocks = w.astype(np.float32).reshape(w.shape[0], -1, INT8_BLOCK)
    scale = (np.abs(blocks).max(-1) / 127).astype(np.float16)
    inv = np.divide(1.0, scale.astype(np.float32), out=np.zeros(scale.shape, np.float32), where=scale > 0)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int8)
    return q.reshape(w.shape), scale


def read_torch_bin(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path.name}: reading .bin checkpoints needs PyTorch (pip install torch)") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for truncated zips and bad pickles
        raise CheckpointError(f"{path.name}: cannot read PyTorch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path.name}: not a state dict")
    return {k: v.detach().to(torch.float32).numpy() for k, v in state.items() if hasattr(v, "detach")}


def _weight_files(folder: Path) -> list[Path]:
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = folder / index_name
        if index.exists():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index_name}: corrupt index ({e})") from None
            missing = [s for s in shards if not (folder / s).exists()]
            if missing:
                raise CheckpointError(f"{index_name}: missing shard(s) {', '.join(missing)}")
            return [folder / s for s in shards]
        if (folder / single).exists():
            return [folder / single]
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin found")


@dataclass
class EagleHead:
    """An EAGLE-1/2 head: one decoder layer without input_layernorm, plus fc over [emb, feature]."""

    config: dict
    tensors: dict[str, np.ndarray]  # official names, float32
    hidden_size: int
    intermediate_size: int
    n_head: int
    n_head_kv: int
    rms_norm_eps: float
    rope_theta: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head


REQUIRED = (
    "fc.weight",
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
    "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
    "layers.0.post_attention_layernorm.weight",
)
OPTIONAL = (
    "fc.bias", "embed_tokens.weight",
    "layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias",
)


def load_head(folder: str | Path) -> EagleHead:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a folder (expected an HF folder with config.json)")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: no config.json, not an EAGLE checkpoint")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json: invalid JSON ({e})") from None

    tensors: dict[str, np.ndarray] = {}
    for f in _weight_files(folder):
        tensors.update(read_safetensors(f) if f.suffix == ".safetensors" else read_torch_bin(f))
    # some exports prefix everything with "model."
    if tensors and all(k.startswith("model.") for k in tensors):
        tensors = {k[len("model."):]: v for k, v in tensors.items()}

    if "fc.weight" not in tensors:
        raise CheckpointError(f"{folder}: no fc.weight, not an EAGLE-1/2 checkpoint")
    if any(k.startswith("layers.1.") for k in tensors) or "d2t" in tensors or "midlayer.self_attn.q_proj.weight" in tensors:
        raise CheckpointError(f"{folder}: not an EAGLE-1/2 head (more than one layer, or an EAGLE-3 head)")
    missing = [k for k in REQUIRED if k not in tensors]
    if missing:
        raise CheckpointError(f"missing tensor(s): {', '.join(missing)}")
    unknown = sorted(set(tensors) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise CheckpointError(f"unknown tensor(s): {', '.join(unknown)}")

    try:
        hidden = int(cfg["hidden_size"])
        n_head = int(cfg["num_attention_heads"])
        inter = int(cfg["intermediate_size"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"config.json: missing or bad field {e}") from None
    head_dim = hidden // n_head if n_head > 0 else 0
    kv_rows = tensors["layers.0.self_attn.k_proj.weight"].shape[0]
    if head_dim == 0 or kv_rows == 0 or kv_rows % head_dim:
        raise CheckpointError(f"k_proj.weight rows ({kv_rows}) are not a multiple of head_dim {head_dim}")
    # the KV head count comes from the tensors: some configs disagree with their checkpoints
    n_head_kv = kv_rows // head_dim
    head = EagleHead(cfg, tensors, hidden, inter, n_head, n_head_kv,
                     float(cfg.get("rms_norm_eps", 1e-6)), float(cfg.get("rope_theta", 10000.0)))
    _check_shapes(head)
    return head


def _check_shapes(h: EagleHead) -> None:
    H, I, D = h.hidden_size, h.intermediate_size, h.head_dim
    kv = h.n_head_kv * D
    expect = {
        "fc.weight": (H, 2 * H), "fc.bias": (H,),
        "embed_tokens.weight": (None, H),
        "layers.0.self_attn.q_proj.weight": (h.n_head * D, H), "layers.0.self_attn.q_proj.bias": (h.n_head * D,),
        "layers.0.self_attn.k_proj.weight": (kv, H), "layers.0.self_attn.k_proj.bias": (kv,),
        "layers.0.self_attn.v_proj.weight": (kv, H), "layers.0.self_attn.v_proj.bias": (kv,),
        "layers.0.self_attn.o_proj.weight": (H, h.n_head * D),
        "layers.0.mlp.gate_proj.weight": (I, H), "layers.0.mlp.up_proj.weight": (I, H),
        "layers.0.mlp.down_proj.weight": (H, I),
        "layers.0.post_attention_layernorm.weight": (H,),
    }
    for name, arr in h.tensors.items():
        want = expect[name]
        if len(arr.shape) != len(want) or any(w is not None and w != a for w, a in zip(want, arr.shape)):
            raise CheckpointError(f"shape mismatch: {name} is {list(arr.shape)}, expected "
                                  f"{[w if w is not None else 'n_vocab' for w in want]} for hidden_size {H}")
    if h.n_head % h.n_head_kv:
        raise CheckpointError(f"{h.n_head} attention heads are not a multiple of {h.n_head_kv} KV heads")
