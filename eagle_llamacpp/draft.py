"""The EAGLE-1/2 draft head, run by the patched libllama next to its target."""

from __future__ import annotations

import ctypes
import warnings
from pathlib import Path

import numpy as np
from . import _native as nat
from .constants import TARGET_ARCH_KEY, TARGET_LAYERS_KEY, TARGET_NAME_KEY


class _ModelContext:
    """Owns one llama_model and its llama_context, freed together."""

    model = None
    ctx = None

    def close(self) -> None:
        if self.ctx:
            nat.llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            nat.llama_cpp.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        self.close()


class TargetModel(_ModelContext):
    """A target model whose context exports the final hidden state of every batch token."""

    def __init__(self, path: str | Path, *, n_ctx: int = 2048, n_batch: int = 512, n_threads: int = 2,
                 n_gpu_layers: int = 0, flash_attn: bool | None = None, n_seq_max: int = 1,
                 kv_unified: bool = True, n_ubatch: int | None = None, repack: bool | None = None):
        self.path = Path(path)
        self.model = nat.load_model(self.path, n_gpu_layers, repack)
        self.arch = nat.model_arch(self.model)
        self.n_embd = nat.n_embd(self.model)
        self.n_vocab = nat.n_vocab(self.model)
        self.ctx = nat.new_context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                   flash_attn=flash_attn, n_seq_max=n_seq_max, kv_unified=kv_unified,
                                   n_ubatch=n_ubatch)
        nat.set_feature_export(self.ctx, True, per_output=False)

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        vocab = nat.llama_cpp.llama_model_get_vocab(self.model)
        data = text.encode()
        size = len(data) + 16
        while True:
            buf = (nat.llama_cpp.llama_token * size)()
            n = nat.llama_cpp.llama_tokenize(vocab, data, len(data), buf, size, add_special, True)
            if n >= 0:
                return list(buf[:n])
            size = -n  # too small: llama_tokenize returns minus the size it needs

    def piece(self, token: int) -> str:
        vocab = nat.llama_cpp.llama_model_get_vocab(self.model)
        buf = (ctypes.c_char * 256)()
        n = nat.llama_cpp.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
        return bytes(buf[:max(n, 0)]).decode("utf-8", "replace")

    def decode(self, tokens, pos, outputs=None, *, tree=None, seq_ids=None):
        """Decodes tokens at positions pos; tree=(nodes, parents) decodes them as a token tree."""
        nat.decode(self.ctx, tokens, pos, outputs=outputs, tree=tree, seq_ids=seq_ids)

    def tree_commit(self, keep, seq_id: int = 0) -> None:
        nat.tree_commit(self.ctx, keep, seq_id)

    def logits(self, i: int) -> np.ndarray:
        return nat.logits_ith(self.ctx, i, self.n_vocab)

    def feature(self, i: int) -> np.ndarray:
        return nat.features_ith(self.ctx, i, self.n_embd)


class EagleDraft(_ModelContext):
    """An `eagle2` GGUF head. Token embeddings and lm_head come from the target when the GGUF has none.

    A draft converted with a draft vocabulary (d2t) computes logits over those target tokens only;
    its rows are then indexed by draft-vocabulary index (token_ids() maps them to target ids).
    """

    def __init__(self, path: str | Path, target: TargetModel, *, n_ctx: int = 2048, n_batch: int = 512,
                 n_threads: int = 2, n_gpu_layers: int = 0, flash_attn: bool | None = None):
        self.path = Path(path)
        self.target = target
        self.model = nat.load_model(self.path, n_gpu_layers)
        arch = nat.model_arch(self.model)
        if arch != "eagle2":
            nat.llama_cpp.llama_model_free(self.model)
            self.model = None
            raise nat.EagleError(f"{self.path}: architecture '{arch}' is not an EAGLE-1/2 draft (eagle2)")
        self.n_embd = nat.n_embd(self.model)
        self.n_vocab = nat.n_vocab(self.model)
        try:
            # the patched context checks hidden size, vocabulary, target family and the draft vocabulary
            self.ctx = nat.new_context(self.model, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
                                       flash_attn=flash_attn, ctx_other=target.ctx)
            self._check_made_for(target)
        except nat.EagleError as e:
            self.close()
            raise nat.EagleError(f"{self.path}: draft does not fit target {target.path.name}: {e}") from None
        nat.set_feature_export(self.ctx, True, per_output=True)
        # draft vocabulary index -> target token id; None: the draft computes the whole vocabulary
        self.vocab_ids = nat.draft_vocab(self.model)

    @property
    def n_draft_vocab(self) -> int:
        return self.n_vocab if self.vocab_ids is None else len(self.vocab_ids)

    def token_ids(self, idx: np.ndarray) -> np.ndarray:
        """Target token ids of draft-vocabulary indices (the identity without a draft vocabulary)."""
        idx = np.asarray(idx, dtype=np.int32)
        return idx if self.vocab_ids is None else self.vocab_ids[idx]

    def _check_made_for(self, target: TargetModel) -> None:
        """A head converted for another target of the same shape would be lossless but useless:
        refuse another family or depth; another name (a fine-tune, a re-upload) only warns."""
        arch = nat.meta_str(self.model, TARGET_ARCH_KEY)
        if arch is None:
            return  # converted before these keys existed: the shape checks still apply
        layers = int(nat.meta_str(self.model, TARGET_LAYERS_KEY) or 0)
        n_layer = int(nat.llama_cpp.llama_model_n_layer(target.model))
        if arch != target.arch or (layers and layers != n_layer):
            raise nat.EagleError(f"the head was made for a {layers}-layer {arch} target, "
                                 f"this target is a {n_layer}-layer {target.arch}")
        name = nat.meta_str(self.model, TARGET_NAME_KEY)
        target_name = nat.meta_str(target.model, "general.name")
        if name and target_name and name != target_name:
            warnings.warn(f"{self.path.name} was made for '{name}', the target is '{target_name}': "
                          "expect low acceptance if they are different models", stacklevel=3)

    def run(self, tokens, feats, pos, *, rows=None, tree=None):
        """Decodes pairs (tokens[i], feats[i]) at positions pos (optionally as a token tree); returns
        (logits over the draft vocabulary, hidden states) of batch rows `rows` (default: all)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        rows = np.arange(len(tokens)) if rows is None else np.asarray(rows)
        outputs = np.zeros(len(tokens), dtype=np.int8)
        outputs[rows] = 1
        nat.decode(self.ctx, tokens, pos, feats=feats, outputs=outputs, tree=tree)
        hidden = nat.feature_rows(self.ctx, rows, self.n_embd)
        return nat.logits_rows(self.ctx, rows, self.n_vocab, self.vocab_ids), hidden

    def forward(self, tokens, feats, pos, outputs=None):
        """run() for the rows flagged in outputs (default all); (None, None) if none is."""
        rows = None if outputs is None else np.flatnonzero(outputs)
        if rows is not None and len(rows) == 0:
            nat.decode(self.ctx, np.asarray(tokens, np.int32), pos, feats=feats, outputs=np.zeros(len(tokens), np.int8))
            return None, None
        return self.run(tokens, feats, pos, rows=rows)

    def clear(self) -> None:
        nat.clear_memory(self.ctx)
