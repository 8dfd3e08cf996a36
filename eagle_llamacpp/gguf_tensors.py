"""GGUF helpers on gguf-py: (rows of) a GGUF's weights as float32 for training, and metadata copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def dequantize(path: str | Path, name: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Tensor `name` (or only its `rows`) as float32 [rows, cols]; quantized rows dequantize alone."""
    import gguf

    tensor = next((t for t in gguf.GGUFReader(path).tensors if t.name == name), None)
    if tensor is None:
        raise KeyError(f"{Path(path).name} has no tensor {name}")
    return dequantize_tensor(tensor, rows)


def dequantize_tensor(tensor, rows: np.ndarray | None = None) -> np.ndarray:
    """A GGUFReader tensor (or only its `rows`) as float32 [rows, cols]."""
    import gguf

    data = tensor.data if rows is None else tensor.data[np.asarray(rows)]
    return gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)


def lm_head(path: str | Path, rows: np.ndarray | None = None) -> np.ndarray:
    """The output projection, or the token embeddings of a model with tied embeddings."""
    try:
        return dequantize(path, "output.weight", rows)
    except KeyError:
        return dequantize(path, "token_embd.weight", rows)


def copy_field(writer, fld) -> None:
    """Copies one metadata field of a GGUFReader to a GGUFWriter, with its type."""
    import gguf

    vtype = fld.types[0]
    if vtype == gguf.GGUFValueType.ARRAY:
        writer.add_key_value(fld.name, fld.contents(), vtype, sub_type=fld.types[-1])
    else:
        writer.add_key_value(fld.name, fld.contents(), vtype)


def copy_metadata(reader, writer, skip=("general.architecture",)) -> None:
    """Copies every metadata field but the reader's own (GGUF.*) and those in skip."""
    for fld in reader.fields.values():
        if not fld.name.startswith("GGUF.") and fld.name not in skip:
            copy_field(writer, fld)
