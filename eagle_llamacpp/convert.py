"""convert_eagle.py: an EAGLE-1/2 draft checkpoint (HF folder) to an `eagle2` GGUF."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from .checkpoint import CheckpointError, EagleHead, load_head
from .constants import (DRAFT_LM_HEAD_SHARE, DRAFT_VOCAB_FILE, DRAFT_VOCAB_SIZES, TARGET_ARCH_KEY, TARGET_LAYERS_KEY,
                        TARGET_NAME_KEY)
from .gguf_tensors import copy_field

OUTTYPES = ("f32", "f16", "bf16", "q8_0")
SUPPORTED_TARGETS = ("llama", "qwen2")

# official name -> GGUF name (layer 0 only: EAGLE-1/2 heads have one layer)
TENSOR_MAP = {
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.q_proj.bias": "blk.0.attn_q.bias",
    "layers.0.self_attn.k_proj.bias": "blk.0.attn_k.bias",
    "layers.0.self_attn.v_proj.bias": "blk.0.attn_v.bias",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "embed_tokens.weight": "token_embd.weight",
}


class ConvertError(ValueError):
    pass


@dataclass
class TargetInfo:
    arch: str
    hidden_size: int
    n_vocab: int
    n_layer: int = 0
    name: str = ""
    gguf_path: Path | None = None
    tokenizer_fields: list = field(default_factory=list)  # GGUFReader fields to copy
    weight_bytes: int = 0    # all its tensors as stored (GGUF only)
    lm_head_bytes: int = 0   # its output projection, or the token embeddings when they are tied
    # GGUFReader tensors by name (GGUF only): reading a GGUF again takes seconds, mostly its vocabulary
    tensors: dict = field(default_factory=dict, repr=False)


def read_target(path: str | Path) -> TargetInfo:
    """Metadata of the target model, from its GGUF (preferred) or its HF folder."""
    path = Path(path)
    if path.is_dir():
        cfg_path = path / "config.json"
        if not cfg_path.exists():
            raise ConvertError(f"--target {path}: no config.json")
        cfg = json.loads(cfg_path.read_text())
        arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get((cfg.get("architectures") or [""])[0], "")
        return TargetInfo(arch, int(cfg.get("hidden_size", 0)), int(cfg.get("vocab_size", 0)))
    if not path.is_file():
        raise ConvertError(f"--target {path}: no such file or folder")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # GGUFReader raises ValueError/struct errors on junk
        raise ConvertError(f"--target {path}: not a readable GGUF ({e})") from None
    f = reader.fields
    if "general.architecture" not in f:
        raise ConvertError(f"--target {path}: GGUF has no general.architecture")
    arch = f["general.architecture"].contents()
    hidden = int(f[f"{arch}.embedding_length"].contents()) if f"{arch}.embedding_length" in f else 0
    n_vocab = len(f["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in f else 0
    n_layer = int(f[f"{arch}.block_count"].contents()) if f"{arch}.block_count" in f else 0
    model_name = f["general.name"].contents() if "general.name" in f else ""
    tok_fields = [fld for key, fld in f.items() if key.startswith("tokenizer.")]
    tensors = {t.name: t for t in reader.tensors}
    weight_bytes = sum(int(t.n_bytes) for t in tensors.values())
    has_lm_head = bool({"output.weight", "token_embd.weight"} & tensors.keys())
    lm_head_bytes = int(_lm_head(tensors).n_bytes) if has_lm_head else 0
    return TargetInfo(arch, hidden, n_vocab, n_layer, model_name, path, tok_fields, weight_bytes, lm_head_bytes, tensors)


def check_compatible(head: EagleHead, target: TargetInfo) -> None:
    if target.arch not in SUPPORTED_TARGETS:
        raise ConvertError(f"target architecture '{target.arch}' is not supported ({', '.join(SUPPORTED_TARGETS)})")
    if target.hidden_size != head.hidden_size:
        raise ConvertError(f"target mismatch: the head's hidden_size is {head.hidden_size}, "
                           f"the target's is {target.hidden_size}")
    if "embed_tokens.weight" in head.tensors and head.tensors["embed_tokens.weight"].shape[0] != target.n_vocab:
        raise ConvertError(f"target mismatch: the head's embed_tokens has {head.tensors['embed_tokens.weight'].shape[0]} "
                           f"rows, the target's vocabulary {target.n_vocab}")
    vocab = head.config.get("vocab_size")
    if vocab and target.n_vocab and int(vocab) != target.n_vocab:
        raise ConvertError(f"target mismatch: config.json vocab_size is {vocab}, the target's vocabulary {target.n_vocab}")


def _cast(arr: np.ndarray, outtype: str):
    """Returns (data, raw_dtype) for GGUFWriter.add_tensor. Vectors stay f32, as llama.cpp's converter does."""
    if arr.ndim == 1 or outtype == "f32":
        return arr.astype(np.float32), None
    if outtype == "f16":
        return arr.astype(np.float16), None
    qtype = gguf.GGMLQuantizationType.BF16 if outtype == "bf16" else gguf.GGMLQuantizationType.Q8_0
    if qtype == gguf.GGMLQuantizationType.Q8_0 and arr.shape[-1] % 32:
        return arr.astype(np.float16), None
    return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype


def _add_raw(writer, name: str, t, rows: np.ndarray | None = None) -> None:
    """Adds tensor t (or only its rows) bit for bit, in its own type (quantized rows are whole blocks)."""
    data = np.asarray(t.data)
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = data.reshape([int(x) for x in reversed(t.shape.tolist())])  # GGUF stores ne: numpy order reversed
        writer.add_tensor(name, data if rows is None else data[rows])
    else:
        data = data if rows is None else data[rows]  # [rows, bytes per row]
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)


def _lm_head(tensors: dict):
    """The target's output projection, or its token embeddings when they are tied."""
    return tensors["output.weight"] if "output.weight" in tensors else tensors["token_embd.weight"]


def _copy_target_tensors(writer, tensors: dict, with_output: bool) -> None:
    """Embeds the target's token_embd (and its whole lm_head) bit for bit, any quant type."""
    if "token_embd.weight" not in tensors:
        raise ConvertError("--embed-target-head: the target GGUF has no token_embd.weight")
    _add_raw(writer, "token_embd.weight", tensors["token_embd.weight"])
    if with_output:
        _add_raw(writer, "output.weight", _lm_head(tensors))


def _add_draft_vocab(writer, tensors: dict, ids: list[int]) -> None:
    """The draft vocabulary: d2t (draft row -> target token id) and the target's lm_head rows of
    those tokens, copied in their own type, as the draft's own lm_head."""
    rows = np.asarray(ids, dtype=np.int64)
    writer.add_tensor("d2t", rows)
    _add_raw(writer, "output.weight", _lm_head(tensors), rows)


def read_draft_vocab(head_dir: Path, n_vocab: int) -> list[int] | None:
    """draft_vocab.json (written by `eagle-llamacpp train`): target token ids, most frequent first."""
    path = head_dir / DRAFT_VOCAB_FILE
    if not path.exists():
        return None
    try:
        ids = [int(t) for t in json.loads(path.read_text())]
    except (json.JSONDecodeError, TypeError, ValueError) as e:
        raise ConvertError(f"{path.name}: expected a JSON list of token ids ({e})") from None
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n_vocab:
        raise ConvertError(f"{path.name}: token ids must be distinct and within the target's {n_vocab} tokens")
    return ids


def default_draft_vocab(target: TargetInfo) -> int:
    """The draft vocabulary size for a head that lists its tokens, when none is asked for: the largest of
    DRAFT_VOCAB_SIZES whose lm_head rows (the target's, in their own type) weigh at most
    DRAFT_LM_HEAD_SHARE of the target's weights: the 1.5B in F16 and in Q4_K_M get 8192 (0.71%, 0.93%),
    the 0.5B Q4_K_M 4096 (0.80%; 8192 would be 1.61%)."""
    if not (target.weight_bytes and target.lm_head_bytes and target.n_vocab):
        return DRAFT_VOCAB_SIZES[0]
    row_bytes = target.lm_head_bytes / target.n_vocab
    fits = [n for n in DRAFT_VOCAB_SIZES if n * row_bytes <= DRAFT_LM_HEAD_SHARE * target.weight_bytes]
    return max(fits, default=DRAFT_VOCAB_SIZES[0])


def pick_draft_vocab(head_dir: Path, target: TargetInfo, size: int | None) -> list[int] | None:
    """The draft vocabulary to convert with: size None = default_draft_vocab(target) tokens when the head
    lists its frequent tokens (else the whole vocabulary), 0 = the whole vocabulary, N = the N most frequent."""
    if size is not None and size < 0:
        raise ConvertError(f"--draft-vocab must be >= 0 (got {size})")
    ids = read_draft_vocab(head_dir, target.n_vocab)
    if size == 0 or (ids is None and size is None):
        return None
    if ids is None:
        raise ConvertError(f"--draft-vocab {size}: the head has no {DRAFT_VOCAB_FILE} (its tokens by frequency); "
                           "heads trained with `eagle-llamacpp train` have one. Use --draft-vocab 0.")
    n = min(default_draft_vocab(target), len(ids)) if size is None else size
    if n >= target.n_vocab:
        return None  # no smaller than the whole vocabulary
    if n > len(ids):
        raise ConvertError(f"--draft-vocab {n}: {DRAFT_VOCAB_FILE} lists only {len(ids)} tokens")
    return ids[:n]


def convert(head_dir: str | Path, outfile: str | Path, *, target: str | Path, outtype: str = "f16",
            embed_target_head: bool = False, draft_vocab: int | None = None, force: bool = False,
            progress: bool = False) -> Path:
    """draft_vocab: None = the default size when the head lists its tokens, 0 = the whole vocabulary,
    N = the head's N most frequent tokens (see pick_draft_vocab)."""
    if outtype not in OUTTYPES:
        raise ConvertError(f"--outtype must be one of {', '.join(OUTTYPES)}")
    outfile = Path(outfile)
    if outfile.exists() and not force:
        raise ConvertError(f"{outfile} exists (use --force to overwrite)")
    head = load_head(head_dir)
    tgt = read_target(target)
    check_compatible(head, tgt)
    if tgt.gguf_path is None:
        raise ConvertError("--target must be the target's GGUF: the draft GGUF copies its tokenizer from it")
    vocab_ids = pick_draft_vocab(Path(head_dir), tgt, draft_vocab)

    tmp = outfile.with_name(f".{outfile.name}.tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, "eagle2")
    try:
        writer.add_name(Path(head_dir).resolve().name)
        writer.add_context_length(int(head.config.get("max_position_embeddings", 2048)))
        writer.add_embedding_length(head.hidden_size)
        writer.add_feed_forward_length(head.intermediate_size)
        writer.add_block_count(1)
        writer.add_head_count(head.n_head)
        writer.add_head_count_kv(head.n_head_kv)
        writer.add_layer_norm_rms_eps(head.rms_norm_eps)
        writer.add_rope_freq_base(head.rope_theta)
        writer.add_rope_dimension_count(head.head_dim)
        writer.add_target_hidden_size(tgt.hidden_size)
        # which target the head was made for: checked at load (draft.py), beyond the shapes
        writer.add_string(TARGET_ARCH_KEY, tgt.arch)
        writer.add_uint32(TARGET_LAYERS_KEY, tgt.n_layer)
        writer.add_string(TARGET_NAME_KEY, tgt.name)
        writer.add_file_type({"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7}[outtype])
        for fld in tgt.tokenizer_fields:
            copy_field(writer, fld)

        for name, arr in head.tensors.items():
            if name == "embed_tokens.weight":
                continue  # frozen copy of the target's: borrowed at run time (or embedded below)
            data, raw_dtype = _cast(arr, outtype)
            writer.add_tensor(TENSOR_MAP[name], data, raw_dtype=raw_dtype)
        if embed_target_head or vocab_ids is not None:
            tensors = tgt.tensors
            if embed_target_head:
                _copy_target_tensors(writer, tensors, with_output=vocab_ids is None)
            if vocab_ids is not None:
                _add_draft_vocab(writer, tensors, vocab_ids)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        writer.close()
        os.replace(tmp, outfile)
    finally:
        if tmp.exists():
            tmp.unlink()
    return outfile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="convert_eagle.py",
                                description="Convert an EAGLE-1/2 draft head (HF folder) to an eagle2 GGUF.")
    p.add_argument("model", help="HF folder with config.json and model.safetensors or pytorch_model.bin")
    p.add_argument("--target", required=True, help="the target model's GGUF (tokenizer, checks)")
    p.add_argument("--outfile", help="output GGUF (default: <model>/eagle2-<outtype>.gguf)")
    p.add_argument("--outtype", default="f16", choices=OUTTYPES)
    p.add_argument("--embed-target-head", action="store_true",
                   help="store the target's token embeddings and lm_head in the draft GGUF")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="the draft's lm_head covers the head's N most frequent target tokens (draft_vocab.json); "
                        "0 = the whole vocabulary (default, when the head lists its tokens: sized to the target, "
                        f"the largest of {', '.join(map(str, DRAFT_VOCAB_SIZES))} whose lm_head rows weigh at "
                        f"most {DRAFT_LM_HEAD_SHARE * 100:.2f}%% of its weights)")  # %%: argparse formats help with %
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    outfile = args.outfile or str(Path(args.model) / f"eagle2-{args.outtype}.gguf")
    try:
        out = convert(args.model, outfile, target=args.target, outtype=args.outtype,
                      embed_target_head=args.embed_target_head, draft_vocab=args.draft_vocab, force=args.force,
                      progress=not args.no_progress)
    except (CheckpointError, ConvertError, OSError) as e:
        print(f"convert_eagle.py: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0
