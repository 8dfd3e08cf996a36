"""Heads that ship with the repo (trained by `eagle-llamacpp train`, HF layout under heads/), and
their GGUF drafts, converted once per target and cached next to the models."""

from __future__ import annotations

import hashlib
from pathlib import Path

from ._native import REPO_ROOT
from .models import QWEN25_CODER_05B, QWEN25_CODER_15B, SMOLLM2_135M, PackagedModel, cache_dir

HEADS_DIR = REPO_ROOT / "heads"

# default target -> the folder of its shipped head
SHIPPED = {QWEN25_CODER_05B.name: "qwen2.5-coder-0.5b-instruct", QWEN25_CODER_15B.name: "qwen2.5-coder-1.5b-instruct",
           SMOLLM2_135M.name: "smollm2-135m-instruct"}


def shipped_head(target: PackagedModel) -> Path:
    folder = HEADS_DIR / SHIPPED[target.name]
    if not (folder / "model.safetensors").exists():
        raise FileNotFoundError(f"no shipped head for {target.name} in {folder}")
    return folder


def draft_gguf(head_dir: Path, target_gguf: Path, draft_vocab: int | None = None, outtype: str = "q8_0") -> Path:
    """The head converted for target_gguf, cached by the head's and the target's contents.
    draft_vocab: as convert() takes it (None: the default size, chosen for the target; 0: the whole
    vocabulary); outtype: the draft's weight type, as convert() takes it. q8_0 by default: on the
    2-core CPU it drafted in 24% less time than f16 with the same acceptance
    (benchmarks/draft_vocab.py --types)."""
    from .constants import DRAFT_LM_HEAD_SHARE, DRAFT_VOCAB_SIZES
    from .convert import convert

    h = hashlib.sha256()
    for f in sorted(head_dir.iterdir()):
        if f.suffix in (".json", ".safetensors"):
            h.update(f.name.encode() + f.read_bytes())
    h.update(target_gguf.name.encode() + str(target_gguf.stat().st_size).encode())
    vocab = "default" if draft_vocab is None else str(draft_vocab)
    # the default's sizing rule goes into the key (not its result: reading the target's GGUF to size it
    # takes seconds), so a draft converted under another rule is not reused
    rule = f":{DRAFT_VOCAB_SIZES}:{DRAFT_LM_HEAD_SHARE}" if draft_vocab is None else ""
    h.update(b"draft_vocab=" + (vocab + rule).encode())
    out = cache_dir() / "drafts" / h.hexdigest()[:16] / f"{head_dir.name}-eagle2-{outtype}-vocab{vocab}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(head_dir, out, target=target_gguf, outtype=outtype, draft_vocab=draft_vocab, force=True)
    return out
