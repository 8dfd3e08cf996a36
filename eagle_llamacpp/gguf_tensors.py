"""Reading (rows of) a GGUF's weights as float32 with gguf-py, for training and the draft vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def dequantize(path: str | Path, name: str, rows: np.ndarray | None = None) -> np.ndarray:
    """Tensor `name` (or only its `rows`) as float32 [rows, cols]; quantized rows dequantize alone."""
    import gguf

    tensor = next((t for t in gguf.GGUFReader(path).tensors if t.name == name), None)
    if tensor is None:
        raise KeyError(f"{Path(path).name} has no tensor {name}")
    data = tensor.data if rows is None else tensor.data[np.asarray(rows)]
    return gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)


def lm_head(path: str | Path, rows: np.ndarray | None = None) -> np.ndarray:
    """The output projection, or the token embeddings of a model with tied embeddings."""
    try:
        return dequantize(path, "output.weight", rows)
    except KeyError:
        return dequantize(path, "token_embd.weight", rows)
