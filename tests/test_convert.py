"""convert_eagle.py: round trip, options, and every bad-input case."""

import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from eagle_llamacpp.convert import TENSOR_MAP, convert

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args):
    return subprocess.run([sys.executable, str(REPO / "convert_eagle.py"), *map(str, args), "--no-progress"],
                          capture_output=True, text=True)


def gguf_tensors(path):
    r = gguf.GGUFReader(path)
    return r, {t.name: t for t in r.tensors}


HEAD_KV = {"llama": 4, "qwen2": 2}


@pytest.mark.parametrize("style,fmt", [("llama", "safetensors"), ("qwen2", "bin")])
def test_round_trip_f32(style, fmt, head_folder, targets, tmp_path):
    folder, cfg, ts = head_folder(style, fmt, embed=True)
    out = convert(folder, tmp_path / "d.gguf", target=targets[style][0], outtype="f32")
    reader, by_name = gguf_tensors(out)
    assert reader.fields["general.architecture"].contents() == "eagle2"
    assert reader.fields["eagle2.target_hidden_size"].contents() == 64
    assert reader.fields["eagle2.attention.head_count_kv"].contents() == HEAD_KV[style]
    # the tokenizer is the target's
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 320
    expected = {TENSOR_MAP[k]: v for k, v in ts.items() if k != "embed_tokens.weight"}
    assert set(by_name) == set(expected)  # embed_tokens is dropped: borrowed from the target
    for name, arr in expected.items():
        np.testing.assert_array_equal(np.asarray(by_name[name].data).reshape(arr.shape), arr, err_msg=name)



def test_embed_target_head_copies_target_tensors(head_folder, targets, tmp_path):
    folder, _, _ = head_folder("llama")
    path, tgt = targets["llama"]
    out = convert(folder, tmp_path / "d.gguf", target=path, outtype="f32", embed_target_head=True)
    _, by_name = gguf_tensors(out)
    np.testing.assert_array_equal(np.asarray(by_name["token_embd.weight"].data), tgt["token_embd.weight"])
    np.testing.assert_array_equal(np.asarray(by_name["output.weight"].data), tgt["output.weight"])


@pytest.mark.parametrize("outtype,qtype", [("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")])
def test_outtypes(outtype, qtype, head_folder, targets, tmp_path):
    folder, _, _ = head_folder("llama")
    out = convert(folder, tmp_path / "d.gguf", target=targets["llama"][0], outtype=outtype)
    _, by_name = gguf_tensors(out)
    assert by_name["fc.weight"].tensor_type.name == qtype
    assert by_name["blk.0.ffn_norm.weight"].tensor_type.name == "F32"  # vectors stay f32


def test_cli_no_overwrite_without_force(head_folder, targets, tmp_path):
    folder, _, _ = head_folder("llama")
    out = tmp_path / "d.gguf"
    out.write_bytes(b"keep me")
    r = run_cli(folder, "--target", targets["llama"][0], "--outfile", out)
    assert r.returncode != 0 and "--force" in r.stderr
    assert out.read_bytes() == b"keep me"
    r = run_cli(folder, "--target", targets["llama"][0], "--outfile", out, "--force")
    assert r.returncode == 0, r.stderr
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == "eagle2"
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed away


def _bad_case(kind, head_folder, targets, tmp_path):
    """Returns (folder, target) for one kind of bad input."""
    folder, cfg, ts = head_folder("llama")
    bad = tmp_path / kind
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    target = targets["llama"][0]
    from tiny_models import save_head
    if kind == "not_eagle":
        save_head(bad, {"hidden_size": 64}, {"model.layers.0.mlp.up_proj.weight": ts["layers.0.mlp.up_proj.weight"]})
    elif kind == "missing_tensor":
        save_head(bad, cfg, {k: v for k, v in ts.items() if "o_proj" not in k})
    elif kind == "unknown_tensor":
        save_head(bad, cfg, {**ts, "layers.0.extra.weight": np.zeros(4, np.float32)})
    elif kind == "shape_mismatch":
        save_head(bad, cfg, {**ts, "fc.weight": np.zeros((64, 100), np.float32)})
    elif kind == "truncated":
        save_head(bad, cfg, ts)
        data = (bad / "model.safetensors").read_bytes()
        (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind == "corrupt":
        (bad / "model.safetensors").write_bytes(b"\xff" * 64)
    elif kind == "corrupt_bin":
        (bad / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip")
    elif kind == "target_mismatch":
        from tiny_models import make_head
        cfg2, ts2 = make_head(hidden=32, inter=48)
        save_head(bad, cfg2, ts2)
    elif kind == "target_not_gguf":
        save_head(bad, cfg, ts)
        target = tmp_path / "junk.gguf"
        target.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    elif kind == "no_config":
        (bad / "config.json").unlink()
    return bad, target


BAD_CASES = {
    "not_eagle": "not an EAGLE", "missing_tensor": "missing tensor", "unknown_tensor": "unknown tensor",
    "shape_mismatch": "shape mismatch", "truncated": "truncated", "corrupt": "corrupt",
    "corrupt_bin": "cannot read PyTorch checkpoint", "target_mismatch": "target mismatch",
    "target_not_gguf": "not a readable GGUF", "no_config": "no config.json",
}


@pytest.mark.parametrize("kind", sorted(BAD_CASES))
def test_bad_input_one_line_error(kind, head_folder, targets, tmp_path):
    folder, target = _bad_case(kind, head_folder, targets, tmp_path)
    out = tmp_path / "out.gguf"
    r = run_cli(folder, "--target", target, "--outfile", out)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convert_eagle.py: error:"), r.stderr
    assert BAD_CASES[kind] in lines[0], lines[0]
    assert not out.exists()


def test_sharded_safetensors_equal_single_file(head_folder, targets, tmp_path):
    from safetensors.numpy import save_file
    folder, cfg, ts = head_folder("qwen2")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(cfg))
    names = sorted(ts)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: ts[k] for k in keys}, str(sharded / shard))
        weight_map.update({k: shard for k in keys})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = convert(folder, tmp_path / "a.gguf", target=targets["qwen2"][0], outtype="f32")
    b = convert(sharded, tmp_path / "b.gguf", target=targets["qwen2"][0], outtype="f32")
    _, ta = gguf_tensors(a)
    _, tb = gguf_tensors(b)
    assert set(ta) == set(tb)
    for name in ta:
        np.testing.assert_array_equal(np.asarray(ta[name].data), np.asarray(tb[name].data), err_msg=name)


def test_sharded_index_with_missing_shard_is_an_error(head_folder, targets, tmp_path):
    folder, cfg, ts = head_folder("llama")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"fc.weight": "model-00001.safetensors"}}))
    r = run_cli(bad, "--target", targets["llama"][0], "--outfile", tmp_path / "o.gguf")
    assert r.returncode == 1 and "missing shard" in r.stderr and "Traceback" not in r.stderr


def test_target_of_unsupported_family_is_refused(head_folder, tmp_path):
    from tiny_models import write_target
    folder, _, _ = head_folder("llama")
    qwen3 = tmp_path / "qwen3.gguf"
    write_target(qwen3, "qwen3")
    r = run_cli(folder, "--target", qwen3, "--outfile", tmp_path / "o.gguf")
    assert r.returncode == 1 and "target architecture 'qwen3' is not supported" in r.stderr


@pytest.mark.parametrize("command", [[str(REPO / "convert_eagle.py")],
                                     ["-m", "eagle_llamacpp.cli", "convert"],
                                     ["-m", "eagle_llamacpp.cli", "generate"],
                                     ["-m", "eagle_llamacpp.cli", "train"],
                                     ["-m", "eagle_llamacpp.cli", "bench"]])
def test_help_renders(command):
    """argparse formats help text with %: a bare % in an option's help made --help crash."""
    r = subprocess.run([sys.executable, *command, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout and "--" in r.stdout
