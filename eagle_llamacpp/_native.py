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

# C functions that only the patched libllama exports (patches 0003 and 0004)
_PATCHED_SYMBOLS = (
    "llama_set_eagle_features",
    "llama_get_eagle_features_ith",
    "llama_model_n_draft_vocab",
    "llama_batch_ext_set_tree",
    "llama_memory_tree_commit",
)


class EagleError(RuntimeError):
    """A clear, user-facing error from eagle_llamacpp."""


def library_dir() -> Path:
    """Folder holding the patched libllama: $EAGLE_LLAMACPP_LIB, else the repo's build/bin."""
    env = os.environ.get("EAGLE_LLAMACPP_LIB")
    return Path(env) if env else REPO_ROOT / "build" / "bin"


def library_stamp() -> str:
    """Size and modification time of the libraries in library_dir(): what a rebuild changes, so that
    timings cached for one build (autotune) are not reused with another's kernels."""
    lib_dir = library_dir()
    parts = []
    for path in sorted(lib_dir.iterdir()) if lib_dir.is_dir() else []:
        if path.name.startswith(("libllama", "libggml")) and not path.is_symlink() and path.is_file():
            st = path.stat()
            parts.append(f"{path.name}:{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


def check_patched(cdll) -> None:
    """Raises EagleError unless the ctypes library `cdll` is our patched libllama."""
    missing = [sym for sym in _PATCHED_SYMBOLS if not hasattr(cdll, sym)]
    if missing:
        raise EagleError(
            f"llama_cpp loaded an unpatched libllama ({cdll._name}); eagle_llamacpp needs the "
            f"patched build in {library_dir()}. Import eagle_llamacpp before llama_cpp, or set "
            "LLAMA_CPP_LIB_PATH to that folder.")


def _preload_ggml(lib_dir: Path) -> None:
    """Loads lib_dir's ggml libraries before its libllama, so that libllama links to them: its
    RUNPATH names the build folder it was linked in, whose ggml (another build's, after a rebuild)
    would otherwise be taken, silently, where EAGLE_LLAMACPP_LIB points at a copy of a build."""
    if not sys.platform.startswith("linux"):
        return
    backends = sorted(p for p in lib_dir.glob("libggml-*.so") if p.name != "libggml-base.so")
    for path in [lib_dir / "libggml-base.so", *backends, lib_dir / "libggml.so"]:
        if path.exists():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise EagleError(f"cannot load {path}: {e}") from None


def _import_llama_cpp():
    lib_dir = library_dir()
    if "llama_cpp" not in sys.modules:
        if not (lib_dir / "libllama.so").exists() and not (lib_dir / "libllama.dylib").exists():
            raise EagleError(f"patched libllama not found in {lib_dir}: run `make build` first "
                             "or set EAGLE_LLAMACPP_LIB")
        os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
        _preload_ggml(lib_dir)
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
lib.llama_model_n_draft_vocab.argtypes = [llama_cpp.llama_model_p_ctypes]
lib.llama_model_n_draft_vocab.restype = ctypes.c_int32
lib.llama_model_get_draft_vocab.argtypes = [llama_cpp.llama_model_p_ctypes, ctypes.POINTER(llama_cpp.llama_token),
                                            ctypes.c_int32]
lib.llama_model_get_draft_vocab.restype = ctypes.c_int32
lib.llama_batch_ext_set_tree.argtypes = [llama_cpp.llama_batch_ext_p_ctypes, ctypes.c_int32, ctypes.c_int32,
                                         ctypes.c_int32]
lib.llama_batch_ext_set_tree.restype = ctypes.c_bool
lib.llama_memory_tree_commit.argtypes = [llama_cpp.llama_memory_t_ctypes, llama_cpp.llama_seq_id,
                                         ctypes.POINTER(ctypes.c_int32), ctypes.c_int32]
lib.llama_memory_tree_commit.restype = ctypes.c_bool


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

def use_extra_bufts() -> bool:
    # ggml's weight repacking, as llama.cpp does by default. On AMX CPUs it used to crash the first
    # tile instruction (fixed by patch 0007); EAGLE_LLAMACPP_REPACK=0 turns it off.
    return os.environ.get("EAGLE_LLAMACPP_REPACK", "1") != "0"


def batch_repack(system_info: str | None = None) -> bool:
    """Weight repacking for batch work (feature extraction, self-distillation: 32-1024 tokens a
    decode). On AVX512-VNNI CPUs without AMX, K-quant weights left as stored run ggml's tiled VNNI
    kernels, which took batches of 32-512 tokens 1.15-1.5x faster than the repacked AVX2 gemm
    (AMD Zen 4, Qwen2.5-Coder-1.5B Q4_K_M); with AMX the repacked weights take its tiles, and on
    AVX2 alone the two were even. Decoding and verifying keep repacking (use_extra_bufts): its
    row kernels are faster there. EAGLE_LLAMACPP_REPACK decides for both where set."""
    if "EAGLE_LLAMACPP_REPACK" in os.environ:
        return use_extra_bufts()
    if system_info is None:
        system_info = llama_cpp.llama_print_system_info().decode()
    return "AMX_INT8 = 1" in system_info or "AVX512_VNNI = 1" not in system_info


def load_model(path: str | os.PathLike, n_gpu_layers: int = 0, repack: bool | None = None):
    """repack: ggml's weight repacking for this model (default: use_extra_bufts())."""
    path = Path(path)
    if not path.is_file():
        raise EagleError(f"{path}: no such file")
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = n_gpu_layers
    params.use_extra_bufts = use_extra_bufts() if repack is None else repack
    last_errors()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise EagleError(f"{path}: cannot load model: {last_errors() or 'unknown error'}")
    return model


def new_context(model, *, n_ctx: int, n_batch: int, n_threads: int, flash_attn: bool | None = None,
                ctx_other=None, embeddings: bool = False, n_seq_max: int = 1, kv_unified: bool = True,
                n_ubatch: int | None = None):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_ubatch or n_batch
    params.n_seq_max = n_seq_max
    params.kv_unified = kv_unified
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


def meta_str(model, key: str, size: int = 256) -> str | None:
    """A GGUF metadata value as a string; None if the model has no such key."""
    buf = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else None


def model_arch(model) -> str:
    return meta_str(model, "general.architecture") or ""


def n_embd(model) -> int:
    return int(llama_cpp.llama_model_n_embd(model))


def n_vocab(model) -> int:
    return int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model)))


# --- batches ---------------------------------------------------------------------------------

def decode(ctx, tokens, pos, *, outputs=None, feats=None, seq_ids=None, tree=None) -> None:
    """One llama_decode of `tokens` at positions `pos`, through a llama_batch_ext.

    outputs: 0/1 per token, whether it produces logits (default: every token).
    feats:   one feature row per token (the draft's second input).
    seq_ids: the sequence of each token (default 0).
    tree:    (nodes, parents) per token: the tokens become nodes of a token tree
             (llama_batch_ext_set_tree): each one attends to the committed cells of its sequence and
             to its own ancestors only. Close the tree with tree_commit().
    """
    n = len(tokens)
    tokens = np.asarray(tokens, dtype=np.int32)
    pos = np.ascontiguousarray(pos, dtype=np.int32)
    outputs = np.ones(n, dtype=bool) if outputs is None else np.asarray(outputs, dtype=bool)
    seq_ids = np.zeros(n, dtype=np.int32) if seq_ids is None else np.broadcast_to(np.asarray(seq_ids), (n,))
    if feats is not None:
        feats = np.ascontiguousarray(feats, dtype=np.float32)
        row = llama_cpp.llama_embd(None, 1, feats.shape[1])
        row_bytes = feats.shape[1] * 4
    if tree is not None:
        nodes, parents = (np.asarray(a, dtype=np.int64) for a in tree)

    batch = lib.llama_batch_ext_init(ctx)
    try:
        for i in range(n):
            idx = lib.llama_batch_ext_add_token(batch, int(seq_ids[i]), int(tokens[i]))
            if idx < 0:
                raise EagleError(f"cannot add token {i} (id {int(tokens[i])}, seq {int(seq_ids[i])}) to the "
                                 f"batch: " + {-1: f"more than n_batch = {llama_cpp.llama_n_batch(ctx)} tokens",
                                               -2: "invalid token id", -3: "invalid sequence id"}.get(idx, str(idx)))
            lib.llama_batch_ext_set_pos(batch, idx, ctypes.cast(pos.ctypes.data + 4 * i, _INT32_P))
            lib.llama_batch_ext_set_output_logits(batch, idx, bool(outputs[i]))
            if feats is not None:
                row.data = ctypes.cast(feats.ctypes.data + row_bytes * i, _FLOAT_P)
                if not lib.llama_batch_ext_set_embd_token(batch, idx, row):
                    raise EagleError(f"feature row {i}: {last_errors() or 'rejected'}")
            if tree is not None and not lib.llama_batch_ext_set_tree(batch, idx, int(nodes[i]), int(parents[i])):
                raise EagleError(f"token {i}: invalid tree node {int(nodes[i])} / parent {int(parents[i])}")
        last_errors()
        rc = lib.llama_process(ctx, llama_cpp.LLAMA_PROCESS_TYPE_DECODE, batch)
    finally:
        lib.llama_batch_ext_free(batch)
    if rc != 0:
        raise EagleError(f"llama_decode failed ({rc}): {last_errors() or 'see log'}")


_INT32_P = ctypes.POINTER(ctypes.c_int32)
_FLOAT_P = ctypes.POINTER(ctypes.c_float)


def logits_ith(ctx, i: int, n_vocab_: int) -> np.ndarray:
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    if not ptr:
        raise EagleError(f"no logits for batch index {i}")
    return np.ctypeslib.as_array(ptr, shape=(n_vocab_,)).copy()


def argmax_ith(ctx, i: int, n_vocab_: int) -> int:
    """The argmax of batch index i's logits, read in place (no copy of the vocabulary row)."""
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    if not ptr:
        raise EagleError(f"no logits for batch index {i}")
    return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab_,))))


def _rows(get_ith, ctx, rows, width: int, what: str) -> np.ndarray:
    """Rows `rows` (batch indices) of an output buffer as a [len(rows), width] view: outputs lie
    in batch order, so consecutive rows are usually one block (else one view per row)."""
    ptrs = [ctypes.cast(get_ith(ctx, int(i)), ctypes.c_void_p).value for i in rows]
    if not all(ptrs):
        raise EagleError(f"no {what} for batch index {int(rows[ptrs.index(None)])}")
    stride = width * 4
    if all(p - ptrs[0] == k * stride for k, p in enumerate(ptrs)):
        return np.ctypeslib.as_array(ctypes.cast(ptrs[0], _FLOAT_P), shape=(len(ptrs), width))
    return np.stack([np.ctypeslib.as_array(ctypes.cast(p, _FLOAT_P), shape=(width,)) for p in ptrs])


def logits_rows(ctx, rows, n_vocab_: int, columns: np.ndarray | None = None) -> np.ndarray:
    """Logits of batch indices `rows`, [len(rows), n_vocab] (or only `columns` of them), copied."""
    view = _rows(llama_cpp.llama_get_logits_ith, ctx, rows, n_vocab_, "logits")
    return view.copy() if columns is None else view[:, columns]


def feature_rows(ctx, rows, n_embd_: int) -> np.ndarray:
    """Feature rows of batch indices `rows`, [len(rows), n_embd], copied."""
    return _rows(lib.llama_get_eagle_features_ith, ctx, rows, n_embd_, "feature row").copy()


def draft_vocab(model) -> np.ndarray | None:
    """Target token id of each row of an eagle2 draft's lm_head; None when it covers the whole vocabulary."""
    n = lib.llama_model_n_draft_vocab(model)
    if n <= 0:
        return None
    ids = np.zeros(n, dtype=np.int32)
    got = lib.llama_model_get_draft_vocab(model, ids.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token)), n)
    if got != n:
        raise EagleError(f"cannot read the draft vocabulary ({got} of {n} tokens)")
    return ids


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


def tree_commit(ctx, keep, seq_id: int = 0) -> None:
    """Keeps the open-tree nodes `keep` (a path from a root) as ordinary cells and drops the rest
    of the open tree of `seq_id`; keep=() drops the whole tree. Metadata only, no K/V copies."""
    keep = np.ascontiguousarray(keep, dtype=np.int32)
    last_errors()
    if not lib.llama_memory_tree_commit(llama_cpp.llama_get_memory(ctx), seq_id,
                                        keep.ctypes.data_as(_INT32_P), len(keep)):
        raise EagleError(f"tree commit of {keep.tolist()} failed: {last_errors() or 'see log'}")


def seq_pos_max(ctx, seq_id: int = 0) -> int:
    """Largest position of seq_id in the memory (open-tree nodes included), -1 if empty."""
    return int(llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(ctx), seq_id))


def seq_pos_min(ctx, seq_id: int = 0) -> int:
    return int(llama_cpp.llama_memory_seq_pos_min(llama_cpp.llama_get_memory(ctx), seq_id))


def seq_rm(ctx, seq_id: int, p0: int, p1: int = -1) -> None:
    """Removes the cells of seq_id with positions in [p0, p1) (p1 < 0: to the end)."""
    if not llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(ctx), seq_id, p0, p1):
        raise EagleError(f"cannot remove positions [{p0}, {p1}) of sequence {seq_id}")
