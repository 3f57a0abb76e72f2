"""The real modelscope and huggingface_hub clients download from the fake hub (each in a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimictl.sandbox.checkpoint import checkpoint_manifest, generate_checkpoint
from kimictl.sandbox.fakehub import FakeHub

REPO = "Eco-Tech/Kimi-K2.5-W4A8"
TOKEN = "tok-9f8e7d6c5b4a"
SHARD2 = "quant_model_weights-00002-of-00004.safetensors"

# Each snippet prints one JSON line: {"ok": true, "path": ...} or the error with per-file failures.
MS_SNAPSHOT = """
import json, sys
from modelscope import snapshot_download
kw = json.loads(sys.argv[1])
try:
    print(json.dumps({"ok": True, "path": snapshot_download(**kw)}))
except Exception as e:
    failed = getattr(e, "failed_files", None) or {}
    print(json.dumps({"ok": False, "type": type(e).__name__, "msg": str(e)[:3000],
                      "failed": {k: type(v).__name__ for k, v in failed.items()}}))
"""
MS_FILE = """
import json, sys
from modelscope.hub.file_download import model_file_download
kw = json.loads(sys.argv[1])
print(json.dumps({"ok": True, "path": model_file_download(**kw)}))
"""
HF_SNAPSHOT = """
import json, sys
from huggingface_hub import snapshot_download
kw = json.loads(sys.argv[1])
try:
    print(json.dumps({"ok": True, "path": snapshot_download(**kw)}))
except Exception as e:
    print(json.dumps({"ok": False, "type": type(e).__name__, "msg": str(e)[:3000]}))
"""


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("ckpt")
    generate_checkpoint(dest, total_bytes=5 * 1024 * 1024, num_shards=4, seed=2)
    return dest


@pytest.fixture
def hub(ckpt: Path) -> Iterator[FakeHub]:
    with FakeHub({REPO: ckpt}) as h:
        yield h


def run_client(script: str, kwargs: dict, hub: FakeHub, tmp: Path, **env_extra: str) -> dict:
    """Run a client snippet with the endpoints pointed at the hub and every cache under tmp."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp / "home"),
        "MODELSCOPE_ENDPOINT": hub.url,
        "MODELSCOPE_CACHE": str(tmp / "ms-cache"),
        "MODELSCOPE_HOME": str(tmp / "ms-home"),
        "MODELSCOPE_DOWNLOAD_INTRA_CLOUD": "false",
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(tmp / "hf-home"),
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
        "NO_PROXY": "*",
        **env_extra,
    }
    proc = subprocess.run(
        [sys.executable, "-c", script, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    hub.wait_idle()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"client crashed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def tree(root: Path) -> list[dict]:
    return [e for e in checkpoint_manifest(root)]


def file_requests(hub: FakeHub, name: str) -> list[dict]:
    return [q for q in hub.requests() if name in q["path"] and q["method"] == "GET"]


def test_modelscope_local_dir_byte_exact(hub: FakeHub, ckpt: Path, tmp_path: Path) -> None:
    out = run_client(MS_SNAPSHOT, {"model_id": REPO, "local_dir": str(tmp_path / "dl")}, hub, tmp_path)
    assert out["ok"], out
    assert tree(tmp_path / "dl") == checkpoint_manifest(ckpt)
    # No metadata directory in local_dir mode, and nothing landed outside tmp.
    assert sorted(p.name for p in (tmp_path / "dl").iterdir() if p.name.startswith(".")) == []
    stats = hub.stats()["clients"]["127.0.0.1"]["files"]
    assert stats == {f"{REPO}/{e['path']}": e["size"] for e in checkpoint_manifest(ckpt)}


def test_modelscope_allow_patterns(hub: FakeHub, ckpt: Path, tmp_path: Path) -> None:
    kw = {"model_id": REPO, "local_dir": str(tmp_path / "dl"), "allow_patterns": ["*.json"]}
    out = run_client(MS_SNAPSHOT, kw, hub, tmp_path)
    assert out["ok"], out
    want = [e for e in checkpoint_manifest(ckpt) if e["path"].endswith(".json")]
    assert len(want) >= 5
    assert tree(tmp_path / "dl") == want
    assert not any("FilePath=quant_model_weights-" in q["path"] for q in hub.requests())


def test_modelscope_cache_mode_and_single_file(hub: FakeHub, ckpt: Path, tmp_path: Path) -> None:
    # vllm-ascend fetches quant_model_description.json this way (VLLM_USE_MODELSCOPE), repo id in lower case.
    kw = {"model_id": "Eco-Tech/Kimi-K2.5-w4a8", "file_path": "quant_model_description.json"}
    out = run_client(MS_FILE, kw, hub, tmp_path)
    got = Path(out["path"])
    assert got.is_relative_to(tmp_path / "ms-cache")
    assert got.read_bytes() == (ckpt / "quant_model_description.json").read_bytes()
    assert any(q["path"].endswith("/revisions") for q in hub.requests())


def test_huggingface_local_dir_byte_exact_with_pagination(ckpt: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: ckpt}, hf_page_size=3) as hub:
        out = run_client(HF_SNAPSHOT, {"repo_id": REPO, "local_dir": str(tmp_path / "dl")}, hub, tmp_path)
        assert out["ok"], out
        assert sum("cursor=" in q["path"] for q in hub.requests()) >= 3
    assert tree(tmp_path / "dl") == checkpoint_manifest(ckpt)


def test_huggingface_cache_mode(hub: FakeHub, ckpt: Path, tmp_path: Path) -> None:
    out = run_client(HF_SNAPSHOT, {"repo_id": REPO}, hub, tmp_path)
    assert out["ok"], out
    snap = Path(out["path"])
    assert snap.is_relative_to(tmp_path / "hf-home")
    assert tree(snap) == checkpoint_manifest(ckpt)


def test_modelscope_rejects_wrong_sha(ckpt: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"wrong_sha": ["config.json"]}) as hub:
        out = run_client(MS_SNAPSHOT, {"model_id": REPO, "local_dir": str(tmp_path / "dl")}, hub, tmp_path)
        assert len(file_requests(hub, "FilePath=config.json")) >= 2  # the client retried the bad file
    assert not out["ok"]
    assert out["failed"] == {"config.json": "FileIntegrityError"}
    assert not (tmp_path / "dl" / "config.json").exists()
    assert (tmp_path / "dl" / SHARD2).read_bytes() == (ckpt / SHARD2).read_bytes()


def test_modelscope_resumes_after_drop(ckpt: Path, tmp_path: Path) -> None:
    faults = {"drop": {"files": [SHARD2], "after": 300_000, "times": 1}}
    with FakeHub({REPO: ckpt}, faults=faults) as hub:
        out = run_client(MS_SNAPSHOT, {"model_id": REPO, "local_dir": str(tmp_path / "dl")}, hub, tmp_path)
        gets = file_requests(hub, SHARD2)
    assert out["ok"], out
    assert tree(tmp_path / "dl") == checkpoint_manifest(ckpt)
    assert [(q["status"], q["bytes"], q["range"]) for q in gets][:2] == [
        (200, 300_000, None),
        (206, (ckpt / SHARD2).stat().st_size - 300_000, "bytes=300000-"),
    ]


def test_modelscope_fails_on_truncation(ckpt: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"truncate": [SHARD2]}) as hub:
        out = run_client(
            MS_SNAPSHOT,
            {"model_id": REPO, "local_dir": str(tmp_path / "dl")},
            hub,
            tmp_path,
            MODELSCOPE_DOWNLOAD_MAX_RETRIES="1",
        )
    assert not out["ok"]
    assert list(out["failed"]) == [SHARD2]
    assert not (tmp_path / "dl" / SHARD2).exists()
    assert (tmp_path / "dl" / "config.json").read_bytes() == (ckpt / "config.json").read_bytes()


def test_modelscope_resumes_partial_file_across_runs(ckpt: Path, tmp_path: Path) -> None:
    kw = {"model_id": REPO, "local_dir": str(tmp_path / "dl")}
    with FakeHub({REPO: ckpt}, faults={"truncate": {"files": [SHARD2], "at": 400_000}}) as hub:
        first = run_client(MS_SNAPSHOT, kw, hub, tmp_path, MODELSCOPE_DOWNLOAD_MAX_RETRIES="1")
        assert not first["ok"] and list(first["failed"]) == [SHARD2]
        partial = [p for p in (tmp_path / "dl").iterdir() if p.name.startswith(SHARD2) and p.name != SHARD2]
        assert [p.stat().st_size for p in partial] == [400_000]
        hub.set_faults(None)
        hub.reset_stats()
        second = run_client(MS_SNAPSHOT, kw, hub, tmp_path)
        gets = file_requests(hub, "FilePath=quant_model_weights-")
    assert second["ok"], second
    assert tree(tmp_path / "dl") == checkpoint_manifest(ckpt)
    # Only the unfinished shard is fetched again, from where the first run stopped.
    assert [(q["status"], q["range"]) for q in gets] == [(206, "bytes=400000-")]


def test_huggingface_resumes_after_drop(ckpt: Path, tmp_path: Path) -> None:
    faults = {"drop": {"files": [SHARD2], "after": 300_000, "times": 1}}
    with FakeHub({REPO: ckpt}, faults=faults) as hub:
        out = run_client(HF_SNAPSHOT, {"repo_id": REPO, "local_dir": str(tmp_path / "dl")}, hub, tmp_path)
        gets = file_requests(hub, SHARD2)
    assert out["ok"], out
    assert tree(tmp_path / "dl") == checkpoint_manifest(ckpt)
    # huggingface_hub retries within http_get; it resumes with Range only from whole 10 MiB chunks it has
    # consumed, so a drop this early restarts the file from byte 0.
    assert [(q["status"], q["bytes"]) for q in gets] == [
        (200, 300_000),
        (200, (ckpt / SHARD2).stat().st_size),
    ]


def test_token_auth_with_real_clients(ckpt: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: ckpt}, token=TOKEN) as hub:
        ms_kw = {"model_id": REPO, "local_dir": str(tmp_path / "ms"), "allow_patterns": ["*.json"]}
        denied = run_client(MS_SNAPSHOT, ms_kw, hub, tmp_path / "a")
        ok = run_client(MS_SNAPSHOT, ms_kw, hub, tmp_path / "b", MODELSCOPE_API_TOKEN=TOKEN)
        hf_kw = {"repo_id": REPO, "local_dir": str(tmp_path / "hf")}
        hf_denied = run_client(HF_SNAPSHOT, hf_kw, hub, tmp_path / "c")
        hf_ok = run_client(HF_SNAPSHOT, hf_kw, hub, tmp_path / "d", HF_TOKEN=TOKEN)
        auths = {q["auth"] for q in hub.requests()}
    assert not denied["ok"] and ok["ok"], (denied, ok)
    assert not hf_denied["ok"] and hf_ok["ok"], (hf_denied, hf_ok)
    assert tree(tmp_path / "hf") == checkpoint_manifest(ckpt)
    assert None in auths and auths - {None} <= {"bearer", "cookie:m_session_id", "cookie:modelscope_session"}
