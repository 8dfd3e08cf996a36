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
