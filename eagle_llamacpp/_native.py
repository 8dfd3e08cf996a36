"""The one place that touches the patched libllama through llama-cpp-python's ctypes bindings.

llama_cpp loads its shared library once, at import, from LLAMA_CPP_LIB_PATH. We point it at our
patched build before the first import and then check that the library really is the patched
one, so that an unpatched libllama is never used by accident.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent

# C functions that only the patched libllama exports (patches/0003-eagle-features-c-api.patch)
_PATCHED_SYMBOLS = (
    "llama_set_eagle_features",
    "llama_get_eagle_features_ith",
)


class EagleError(RuntimeError):
    """A clear, user-facing error from eagle_llamacpp."""


def library_dir() -> Path:
    """Folder holding the patched libllama: $EAGLE_LLAMACPP_LIB, else the repo's build/bin."""
    env = os.environ.get("EAGLE_LLAMACPP_LIB")
    return Path(env) if env else REPO_ROOT / "build" / "bin"


def check_patched(cdll) -> None:
    """Raises EagleError unless the ctypes library `cdll` is our patched libllama."""
    missing = [sym for sym in _PATCHED_SYMBOLS if not hasattr(cdll, sym)]
    if missing:
        raise EagleError(
            f"llama_cpp loaded an unpatched libllama ({cdll._name}); eagle_llamacpp needs the "
            f"patched build in {library_dir()}. Import eagle_llamacpp before llama_cpp, or set "
            "LLAMA_CPP_LIB_PATH to that folder.")


def _import_llama_cpp():
    lib_dir = library_dir()
    if "llama_cpp" not in sys.modules:
        if not (lib_dir / "libllama.so").exists() and not (lib_dir / "libllama.dylib").exists():
            raise EagleError(f"patched libllama not found in {lib_dir}: run `make build` first "
                             "or set EAGLE_LLAMACPP_LIB")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    # imported here: llama_cpp loads its library at import, from LLAMA_CPP_LIB_PATH
    import llama_cpp
    import llama_cpp.llama_cpp as llama_cpp_low

    check_patched(llama_cpp_low._lib)
    return llama_cpp


llama_cpp = _import_llama_cpp()

lib = llama_cpp.llama_cpp._lib

# bindings for the functions our patches add to llama.h
lib.llama_set_eagle_features.argtypes = [llama_cpp.llama_context_p_ctypes, ctypes.c_bool, ctypes.c_bool]
lib.llama_set_eagle_features.restype = None
lib.llama_get_eagle_features_ith.argtypes = [llama_cpp.llama_context_p_ctypes, ctypes.c_int32]
lib.llama_get_eagle_features_ith.restype = ctypes.POINTER(ctypes.c_float)


# --- logging: keep llama.cpp quiet, but remember errors so exceptions can carry them ---------

class _LogSink:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lines: list[str] = []
        self.verbose = bool(os.environ.get("EAGLE_LLAMACPP_VERBOSE"))

    def __call__(self, level, text, user_data):
        msg = text.decode("utf-8", "replace")
        if self.verbose:
            sys.stderr.write(msg)
        # GGML_LOG_LEVEL_WARN = 3, ERROR = 4
        if level >= 3:
            with self.lock:
                self.lines.append(msg.strip())
                del self.lines[:-20]

    def take(self) -> str:
        with self.lock:
            out = "; ".join(line for line in self.lines if line)
            self.lines.clear()
        return out


_log_sink = _LogSink()
_log_cb = llama_cpp.llama_log_callback(_log_sink)
llama_cpp.llama_log_set(_log_cb, ctypes.c_void_p(0))
llama_cpp.llama_backend_init()


def last_errors() -> str:
    return _log_sink.take()


# --- models and contexts ---------------------------------------------------------------------

def _use_extra_bufts() -> bool:
    # Off by default: on AMX CPUs ggml repacks weights into an extra buffer type, and the draft's
    # matmuls then segfault in ggml_backend_amx_mul_mat (seen both with the draft's own q8_0
    # weights and with the target's Q4_1 embeddings that the draft borrows). EAGLE_LLAMACPP_REPACK=1
    # turns repacking back on.
    return os.environ.get("EAGLE_LLAMACPP_REPACK") == "1"


def load_model(path: str | os.PathLike, n_gpu_layers: int = 0):
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"{path}: no such file")
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = _use_extra_bufts()
    last_errors()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise EagleError(f"{path}: cannot load model: {last_errors() or 'unknown error'}")
    return model


def new_context(model, *, n_ctx: int, n_batch: int, n_threads: int, flash_attn: bool | None = None,
                ctx_other=None, embeddings: bool = False, n_seq_max: int = 1):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = n_seq_max
    params.n_threads = n_threads
    params.n_threads_batch = n_threads
    params.embeddings = embeddings
    params.no_perf = True
    if flash_attn is not None:
        params.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                  else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
    if ctx_other is not None:
        params.ctx_other = ctx_other
    last_errors()
    ctx = llama_cpp.llama_init_from_model(model, params)
    if not ctx:
        raise EagleError(f"cannot create context: {last_errors() or 'unknown error'}")
    return ctx


def model_arch(model) -> str:
    buf = ctypes.create_string_buffer(64)
    n = llama_cpp.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
    return buf.value.decode() if n >= 0 else ""


def n_embd(model) -> int:
    return int(llama_cpp.llama_model_n_embd(model))


def n_vocab(model) -> int:
    return int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))


# --- batches carrying token ids and (optionally) one feature row per token -------------------

class Batch:
    """A llama_batch whose arrays are numpy-owned; tokens may carry a feature row each."""

    def __init__(self, tokens, pos, *, feats=None, outputs=None, seq_id: int = 0):
        n = len(tokens)
        self.token = np.ascontiguousarray(tokens, dtype=np.int32)
        self.pos = np.ascontiguousarray(pos, dtype=np.int32)
        self.n_seq_id = np.ones(n, dtype=np.int32)
        self.seq_ids = np.full(n, seq_id, dtype=np.int32)
        self.seq_ptrs = (ctypes.POINTER(llama_cpp.llama_seq_id) * n)()
        for i in range(n):
            self.seq_ptrs[i] = ctypes.cast(self.seq_ids[i:].ctypes.data, ctypes.POINTER(llama_cpp.llama_seq_id))
        self.logits = np.ones(n, dtype=np.int8) if outputs is None else np.ascontiguousarray(outputs, dtype=np.int8)
        self.feats = None if feats is None else np.ascontiguousarray(feats, dtype=np.float32)

        b = llama_cpp.llama_batch()
        b.n_tokens = n
        b.token = self.token.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token))
        b.embd = (self.feats.ctypes.data_as(ctypes.POINTER(ctypes.c_float)) if self.feats is not None
                  else ctypes.POINTER(ctypes.c_float)())
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = self.seq_ptrs
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.c = b


def decode(ctx, batch: Batch) -> None:
    last_errors()
    rc = llama_cpp.llama_decode(ctx, batch.c)
    if rc != 0:
        raise EagleError(f"llama_decode failed ({rc}): {last_errors() or 'see log'}")


def logits_ith(ctx, i: int, n_vocab_: int) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    if not ptr:
        raise EagleError(f"no logits for batch index {i}")
    return np.ctypeslib.as_array(ptr, shape=(n_vocab_,)).copy()


def features_ith(ctx, i: int, n_embd_: int) -> np.ndarray:
    """Per-token feature row (target: final hidden state after the output norm; draft: its prediction)."""
    ptr = lib.llama_get_eagle_features_ith(ctx, i)
    if not ptr:
        raise EagleError(f"no feature row for batch index {i}")
    return np.ctypeslib.as_array(ptr, shape=(n_embd_,)).copy()


def set_feature_export(ctx, enable: bool, per_output: bool) -> None:
    """per_output=False: one row per batch token (target); True: one row per output (draft)."""
    lib.llama_set_eagle_features(ctx, enable, per_output)


def clear_memory(ctx) -> None:
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
