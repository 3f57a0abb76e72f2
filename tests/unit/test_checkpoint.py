"""Tests for the generated Kimi-K2.5-W4A8-shaped checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kimictl.sandbox.checkpoint import (
    DESCRIPTION_NAME,
    INDEX_NAME,
    checkpoint_manifest,
    generate_checkpoint,
    parse_size,
    read_safetensors_header,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DTYPE_SIZE = {"I8": 1, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}
SHARD_RE = re.compile(r"^quant_model_weights-(\d{5})-of-(\d{5})\.safetensors$")
SIZE = 6 * 1024 * 1024
SHARDS = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    dest = tmp_path_factory.mktemp("ckpt")
    return dest, generate_checkpoint(dest, total_bytes=SIZE, num_shards=SHARDS, seed=7)


def shards(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if SHARD_RE.match(p.name))


def test_layout_files(ckpt: tuple[Path, list[dict]]) -> None:
    root, manifest = ckpt
    paths = [e["path"] for e in manifest]
    assert paths == sorted(paths)
    for required in (
        "config.json",
        DESCRIPTION_NAME,
        INDEX_NAME,
        "generation_config.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert required in paths
    names = [p.name for p in shards(root)]
    assert names == [f"quant_model_weights-{i:05d}-of-{SHARDS:05d}.safetensors" for i in range(1, SHARDS + 1)]


def test_manifest_matches_files(ckpt: tuple[Path, list[dict]]) -> None:
    root, manifest = ckpt
    assert checkpoint_manifest(root) == manifest
    assert all(set(e) == {"path", "size", "sha256"} for e in manifest)


def test_total_size_close_and_shards_balanced(ckpt: tuple[Path, list[dict]]) -> None:
    root, manifest = ckpt
    total = sum(e["size"] for e in manifest)
    assert abs(total - SIZE) / SIZE < 0.02
    sizes = [p.stat().st_size for p in shards(root)]
    assert max(sizes) / min(sizes) < 1.5
    assert len(set(sizes)) > 1


def test_safetensors_headers_are_valid(ckpt: tuple[Path, list[dict]]) -> None:
    root, _ = ckpt
    for shard in shards(root):
        with open(shard, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        assert n % 8 == 0
        header = read_safetensors_header(shard)
        assert header.pop("__metadata__") == {"format": "pt"}
        offset = 0
        # Offsets must tile the data section exactly, in order, with sizes matching dtype x shape.
        for name, t in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = t["data_offsets"]
            assert begin == offset, name
            count = 1
            for d in t["shape"]:
                count *= d
            assert end - begin == count * DTYPE_SIZE[t["dtype"]], name
            offset = end
        assert shard.stat().st_size == 8 + n + offset


def test_index_is_consistent(ckpt: tuple[Path, list[dict]]) -> None:
    root, _ = ckpt
    index = json.loads((root / INDEX_NAME).read_text())
    seen: dict[str, str] = {}
    data_bytes = 0
    for shard in shards(root):
        header = read_safetensors_header(shard)
        header.pop("__metadata__")
        for name, t in header.items():
            assert name not in seen
            seen[name] = shard.name
            data_bytes += t["data_offsets"][1] - t["data_offsets"][0]
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == data_bytes


def test_description_tags(ckpt: tuple[Path, list[dict]]) -> None:
    root, _ = ckpt
    desc = json.loads((root / DESCRIPTION_NAME).read_text())
    assert desc["model_quant_type"] == "W8A8"
    assert desc["version"] == "1.0.0"
    assert desc["group_size"] == 0
    index = json.loads((root / INDEX_NAME).read_text())
    tensors = set(index["weight_map"])
    assert tensors == {
        k for k in desc if k not in {"model_quant_type", "version", "group_size", "metadata", "optional"}
    }
    seen = set()
    for name in tensors:
        tag = desc[name]
        if ".mlp.experts." in name:
            want = "W4A8_DYNAMIC"
        elif ".self_attn." in name and name.endswith("_proj.weight") and "kv_b_proj" not in name:
            want = "W8A8"
        elif ".mlp.shared_experts." in name or re.search(r"layers\.0\.mlp\.(gate|up|down)_proj", name):
            want = "W8A8_DYNAMIC"
        elif "norm" in name or "embed_tokens" in name:
            want = "FLOAT"
        else:
            continue
        assert tag == want, name
        seen.add(want)
    assert seen == {"W4A8_DYNAMIC", "W8A8", "W8A8_DYNAMIC", "FLOAT"}
    assert "language_model.model.layers.60.mlp.experts.0.gate_proj.weight" in tensors
    assert "language_model.model.layers.61.input_layernorm.weight" not in tensors


def test_config_is_kimi_k25(ckpt: tuple[Path, list[dict]]) -> None:
    root, _ = ckpt
    cfg = json.loads((root / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert cfg["model_type"] == "kimi_k25"
    assert "quantization_config" not in cfg
    text = cfg["text_config"]
    assert (text["num_hidden_layers"], text["hidden_size"], text["n_routed_experts"]) == (61, 7168, 384)
    assert (text["first_k_dense_replace"], text["moe_intermediate_size"], text["vocab_size"]) == (
        1,
        2048,
        163840,
    )
    assert (root / "chat_template.jinja").read_text().strip()


def test_deterministic_and_seeded(tmp_path: Path, ckpt: tuple[Path, list[dict]]) -> None:
    _, manifest = ckpt
    again = generate_checkpoint(tmp_path / "a", total_bytes=SIZE, num_shards=SHARDS, seed=7)
    assert again == manifest
    other = generate_checkpoint(tmp_path / "b", total_bytes=SIZE, num_shards=SHARDS, seed=8)
    shard_sha = {e["path"]: e["sha256"] for e in manifest if SHARD_RE.match(e["path"])}
    other_sha = {e["path"]: e["sha256"] for e in other if SHARD_RE.match(e["path"])}
    assert shard_sha.keys() == other_sha.keys()
    assert all(shard_sha[k] != other_sha[k] for k in shard_sha)
    # Metadata does not depend on the seed; only the weight bytes do.
    assert (tmp_path / "b" / INDEX_NAME).read_bytes() == (tmp_path / "a" / INDEX_NAME).read_bytes()


def test_regenerating_with_fewer_shards_removes_stale_shards(tmp_path: Path) -> None:
    generate_checkpoint(tmp_path, total_bytes=SIZE, num_shards=6)
    (tmp_path / "notes.txt").write_text("mine")
    manifest = generate_checkpoint(tmp_path, total_bytes=SIZE, num_shards=3)
    assert [p.name for p in shards(tmp_path)] == [
        f"quant_model_weights-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    assert checkpoint_manifest(tmp_path) == sorted(
        [*manifest, {"path": "notes.txt", "size": 4, "sha256": hashlib.sha256(b"mine").hexdigest()}],
        key=lambda e: e["path"],
    )


def test_data_is_not_repetitive(ckpt: tuple[Path, list[dict]]) -> None:
    root, _ = ckpt
    data = shards(root)[0].read_bytes()[-(1 << 20) :]
    blocks = [data[i : i + 4096] for i in range(0, len(data), 4096)]
    assert len(set(blocks)) >= 0.95 * len(blocks)
    assert len(set(data)) == 256


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512MiB", 512 << 20),
        ("1GiB", 1 << 30),
        ("1.5GB", 1_500_000_000),
        ("4096", 4096),
        ("25MB/s", 25_000_000),
        ("200Mbit/s", 25_000_000),
        ("64KiB", 65536),
    ],
)
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_rejects_junk() -> None:
    with pytest.raises(ValueError):
        parse_size("lots")


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="too small"):
        generate_checkpoint(tmp_path, total_bytes=100_000, num_shards=2)
    with pytest.raises(ValueError, match="shards"):
        generate_checkpoint(tmp_path, total_bytes=SIZE, num_shards=100_000)
    with pytest.raises(ValueError, match="layout"):
        generate_checkpoint(tmp_path, total_bytes=SIZE, num_shards=2, layout="bf16")


def test_cli_runs_under_plain_python(tmp_path: Path, ckpt: tuple[Path, list[dict]]) -> None:
    python = shutil.which("python3", path="/usr/bin") or sys.executable
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run(
        [
            python,
            "-m",
            "kimictl.sandbox.checkpoint",
            str(tmp_path / "c"),
            "--size",
            "6MiB",
            "--shards",
            str(SHARDS),
            "--seed",
            "7",
            "--manifest",
            str(tmp_path / "m.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "m.json").read_text()) == ckpt[1]
