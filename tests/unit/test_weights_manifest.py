"""The weights manifest: built in-process by the real hub clients from the fake hub's listing."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kimictl.errors import EXIT_INVALID, InvalidInput
from kimictl.sandbox.checkpoint import DESCRIPTION_NAME, INDEX_NAME, checkpoint_manifest, generate_checkpoint
from kimictl.sandbox.fakehub import MALICIOUS_NAMES, FakeHub
from kimictl.weights import manifest as wm
from kimictl.weights.manifest import (
    FileEntry,
    HubAuthError,
    HubNotFound,
    HubUnreachable,
    Manifest,
    UnsafeListing,
    check_names,
    checkpoint_warnings,
    fetch_manifest,
    fetch_small,
    local_manifest,
)

REPO = "Eco-Tech/Kimi-K2.5-W4A8"
TOKEN = "tok-5e4d3c2b1a-manifest"
SOURCES = ["modelscope", "huggingface"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("ckpt")
    generate_checkpoint(dest, total_bytes=5 * 1024 * 1024, num_shards=4, seed=3)
    return dest


@pytest.fixture(scope="module")
def hub(ckpt: Path) -> Iterator[FakeHub]:
    with FakeHub({REPO: ckpt}, token=TOKEN) as h:
        yield h


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def reader(root: Path):
    return lambda p: (root / p).read_bytes()


def test_lazy_import() -> None:
    code = "import sys, kimictl.weights.manifest; print(sorted({'modelscope_hub', 'huggingface_hub'} & {*sys.modules}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("source", SOURCES)
def test_listing_equals_generated_checkpoint(source: str, hub: FakeHub, ckpt: Path) -> None:
    env = dict(os.environ)
    m = fetch_manifest(source, REPO, None, hub.url, TOKEN)
    assert dict(os.environ) == env  # the endpoint went to the client, not into the process environment
    want = checkpoint_manifest(ckpt)
    assert (m.source, m.model_id, m.revision) == (source, REPO, wm.DEFAULT_REVISION[source])
    assert [(f.path, f.size) for f in m.files] == [(w["path"], w["size"]) for w in want]
    assert "docs/deploy_guidance.md" in {f.path for f in m.files}
    assert m.total_bytes == sum(w["size"] for w in want)
    for f, w in zip(m.files, want, strict=True):
        if source == "modelscope" or f.path.endswith(".safetensors"):
            assert (f.sha256, f.git_sha1) == (w["sha256"], None)
        else:  # HF lists only the git blob sha1 for small non-LFS files
            assert f.sha256 is None
            assert f.git_sha1 == git_sha1((ckpt / f.path).read_bytes())
    # Nothing but listing calls reached the hub: no file was downloaded to build the manifest.
    assert not [q for q in hub.requests() if "FilePath=" in q["path"] or "/resolve/" in q["path"]]


def test_hidden_paths_skipped_after_the_name_check(monkeypatch: pytest.MonkeyPatch) -> None:
    sha = "a" * 64
    raw = [(".gitattributes", 10, sha, None), (".msc/x.json", 3, sha, None), ("config.json", 5, sha, None)]
    monkeypatch.setattr(wm, "_list", lambda *a: raw)
    m = fetch_manifest("modelscope", REPO, "v1", "http://127.0.0.1:9", None)
    assert [f.path for f in m.files] == ["config.json"]
    monkeypatch.setattr(wm, "_list", lambda *a: [*raw, (".hidden/../../x", 1, sha, None)])
    with pytest.raises(UnsafeListing, match=r"\.hidden/\.\./\.\./x"):
        fetch_manifest("modelscope", REPO, "v1", "http://127.0.0.1:9", None)


@pytest.mark.parametrize("source", SOURCES)
def test_malicious_listing_refused(source: str, ckpt: Path, tmp_path: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"malicious_names": True}) as hub:
        with pytest.raises(UnsafeListing) as info:
            fetch_manifest(source, REPO, None, hub.url, None)
        requests = hub.requests()
    exc = info.value
    assert exc.code == EXIT_INVALID == 2
    assert "nothing was written" in str(exc)
    assert hub.url in str(exc) and REPO in str(exc)
    for name in MALICIOUS_NAMES:
        assert repr(name) in str(exc)
    assert "\n" not in str(exc) and "\x01" not in str(exc)  # control chars shown escaped
    assert not [q for q in requests if "FilePath=" in q["path"] or "/resolve/" in q["path"]]


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("/etc/passwd", "absolute"),
        ("../x", "'..'"),
        ("docs/../../escape.json", "'..'"),
        ("./config.json", "'.'"),
        ("docs/.", "'.'"),
        ("a\\b", "backslash"),
        ("new\nline.json", "control"),
        ("del\x7f.json", "control"),
        ("nul\x00.json", "control"),
        ("ctl\x01char.json", "control"),
        ("a//b", "empty component"),
        ("docs/", "empty component"),
        ("~/.ssh/authorized_keys", "'~'"),
        ("x" * 256, "255"),
        ("d/" + "é" * 128, "255"),  # 256 bytes on disk
        ("", "empty name"),
    ],
)
def test_check_names_rejects(name: str, why: str) -> None:
    with pytest.raises(UnsafeListing) as info:
        check_names(["config.json", name])
    assert info.value.code == 2
    assert repr(name) in str(info.value)
    assert "'config.json'" not in str(info.value)
    assert f"{name!r}: " in str(info.value) and why in str(info.value)


def test_check_names_accepts_and_rejects_clashes() -> None:
    check_names(["config.json", "docs/deploy_guidance.md", "a/b/c.safetensors", "x" * 255, "a/~b", "v1..2.json",
                 ".gitattributes"])
    with pytest.raises(UnsafeListing, match="listed twice"):
        check_names(["a.json", "b.json", "a.json"])
    with pytest.raises(UnsafeListing, match="'docs' is listed as a file"):
        check_names(["docs", "docs/x.md"])
    with pytest.raises(UnsafeListing) as info:
        check_names(["../x", "ok.json", "/y"])
    assert "'../x'" in str(info.value) and "'/y'" in str(info.value)


@pytest.mark.parametrize("source", SOURCES)
def test_token_is_needed_and_never_shown(source: str, hub: FakeHub, caplog: pytest.LogCaptureFixture,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.DEBUG)
    assert fetch_manifest(source, REPO, None, hub.url, TOKEN).files
    wrong = "wrong-" + TOKEN
    for token in (wrong, None):
        with pytest.raises(HubAuthError) as info:
            fetch_manifest(source, REPO, None, hub.url, token)
        text = info.value.render()
        assert hub.url in str(info.value) and REPO in str(info.value) and "token" in str(info.value)
        assert "\n" not in str(info.value)
        assert info.value.code == 1
        assert TOKEN not in text
    out, err = capfd.readouterr()
    assert TOKEN not in caplog.text + out + err
    assert hub.url in caplog.text  # the clients did log (so the check above looked at something)


def test_client_text_is_redacted(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise RuntimeError(f"header Authorization: Bearer {TOKEN} was refused")

    monkeypatch.setattr(wm, "_list", boom)
    with pytest.raises(wm.HubError) as info:
        fetch_manifest("huggingface", REPO, None, "http://127.0.0.1:9", TOKEN)
    assert "Bearer ***" in info.value.render() and TOKEN not in info.value.render()
    assert str(info.value) == f"huggingface hub http://127.0.0.1:9 failed for {REPO}@main"


@pytest.mark.parametrize("source", SOURCES)
def test_missing_repo_and_revision(source: str, hub: FakeHub, tmp_path: Path) -> None:
    with pytest.raises(HubNotFound) as info:
        fetch_manifest(source, "Eco-Tech/Nope", None, hub.url, TOKEN)
    assert "Eco-Tech/Nope" in str(info.value) and hub.url in str(info.value)
    with pytest.raises(HubNotFound, match=r"revision 'v9' of Eco-Tech/Kimi-K2\.5-W4A8 not found"):
        fetch_manifest(source, REPO, "v9", hub.url, TOKEN)
    with pytest.raises(HubNotFound, match=r"nope\.json"):
        fetch_small(source, REPO, None, hub.url, TOKEN, "nope.json", tmp_path)


def test_unreachable_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    # A socket that accepts connections but never answers: only kimictl's own deadline ends the wait.
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        url = f"http://127.0.0.1:{srv.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(HubUnreachable, match=rf"{url} did not answer for {REPO}@master within 1s"):
            fetch_manifest("modelscope", REPO, None, url, None, timeout=1)
        assert time.monotonic() - start < 5
    # Connection refused: the client's own error, mapped (its listing retries cut to one to keep this fast).
    import modelscope_hub._legacy_api as legacy

    monkeypatch.setattr(legacy, "REPO_TREE_PAGE_MAX_ATTEMPTS", 1)
    with pytest.raises(HubUnreachable, match=f"cannot reach modelscope hub {url} for {REPO}@master"):
        fetch_manifest("modelscope", REPO, None, url, None, timeout=30)


def test_local_source_and_unknown_source() -> None:
    for source in ("local", "s3"):
        with pytest.raises(InvalidInput, match="local_manifest"):
            fetch_manifest(source, REPO, None, None, None)


def test_digest_and_json_round_trip(hub: FakeHub) -> None:
    a = fetch_manifest("modelscope", REPO, None, hub.url, TOKEN)
    b = fetch_manifest("modelscope", REPO, None, hub.url, TOKEN)
    assert a.digest() == b.digest() == Manifest.from_json(a.to_json()).digest()
    assert len(a.digest()) == 64
    shuffled = Manifest(source="modelscope", model_id=REPO, revision="master", files=list(reversed(a.files)))
    assert shuffled.files == a.files and shuffled.digest() == a.digest()
    files = list(a.files)
    files[2] = files[2].model_copy(update={"sha256": "0" * 64})
    assert a.model_copy(update={"files": files}).digest() != a.digest()
    assert a.model_copy(update={"revision": "v2"}).digest() != a.digest()
    assert json.loads(a.to_json())["files"][0]["path"] == a.files[0].path


def test_model_validation() -> None:
    with pytest.raises(ValueError, match="unsafe path"):
        FileEntry(path="../x", size=1, sha256="a" * 64)
    with pytest.raises(ValueError, match="not a hex digest"):
        FileEntry(path="x", size=1, sha256="xyz")
    with pytest.raises(ValueError, match="not a hex digest"):
        FileEntry(path="x", size=1, sha256="a" * 64 + "\n")
    with pytest.raises(ValueError, match="could not be verified"):
        FileEntry(path="x", size=1)
    assert FileEntry(path="x", size=1, sha256="AB" * 32).sha256 == "ab" * 32
    with pytest.raises(ValueError, match="listed twice"):
        Manifest(source="local", model_id="m", revision="r",
                 files=[FileEntry(path="x", size=1, sha256="a" * 64)] * 2)
    with pytest.raises(InvalidInput, match="not a valid weights manifest"):
        Manifest.from_json('{"source": "modelscope", "model_id": "m", "revision": "r", '
                           '"files": [{"path": "/etc/passwd", "size": 1, "sha256": null, "git_sha1": null}]}')


def test_local_manifest(ckpt: Path, tmp_path: Path) -> None:
    m = local_manifest(ckpt, REPO)
    assert (m.source, m.model_id) == ("local", REPO)
    assert [f.model_dump(exclude={"git_sha1"}) for f in m.files] == checkpoint_manifest(ckpt)
    (tmp_path / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / ".cache" / "huggingface" / "x.metadata").write_text("x")
    (tmp_path / ".gitattributes").write_text("*.bin lfs")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "w.bin").write_bytes(b"\0" * 100)
    (tmp_path / "link.json").symlink_to("sub/w.bin")
    got = local_manifest(tmp_path)
    digest = hashlib.sha256(b"\0" * 100).hexdigest()
    assert [(f.path, f.size, f.sha256) for f in got.files] == [("link.json", 100, digest), ("sub/w.bin", 100, digest)]
    with pytest.raises(InvalidInput, match="not a directory"):
        local_manifest(tmp_path / "missing")


@pytest.mark.parametrize("source", SOURCES)
def test_warnings_clean_on_generated_checkpoint(source: str, hub: FakeHub, tmp_path: Path) -> None:
    m = fetch_manifest(source, REPO, None, hub.url, TOKEN)
    fetched: list[str] = []

    def read_small(path: str) -> bytes:
        fetched.append(path)
        return fetch_small(source, REPO, None, hub.url, TOKEN, path, tmp_path)

    assert checkpoint_warnings(m, read_small) == []
    assert sorted(fetched) == sorted([INDEX_NAME, DESCRIPTION_NAME])
    assert (tmp_path / DESCRIPTION_NAME).is_file()
    assert checkpoint_warnings(m, None) == []


def without(m: Manifest, *paths: str) -> Manifest:
    return m.model_copy(update={"files": [f for f in m.files if f.path not in paths]})


def test_warnings_name_the_problem(ckpt: Path) -> None:
    m = local_manifest(ckpt, REPO)
    read = reader(ckpt)
    shard = "quant_model_weights-00003-of-00004.safetensors"

    [w] = checkpoint_warnings(without(m, INDEX_NAME), None)
    assert "safetensors.index.json" in w
    [w] = checkpoint_warnings(without(m, shard), read)
    assert shard in w and "1 shard(s) missing" in w and "fail to load" in w
    assert checkpoint_warnings(without(m, shard), None) == []  # without read_small only presence is checked
    [w] = checkpoint_warnings(without(m, DESCRIPTION_NAME), read)
    assert DESCRIPTION_NAME in w and "vllm-ascend will not load it with --quantization ascend" in w
    assert checkpoint_warnings(without(m, DESCRIPTION_NAME), read, quantization=None) == []
    [w] = checkpoint_warnings(without(m, "config.json"), read)
    assert "config.json" in w
    assert len(checkpoint_warnings(without(m, *[f.path for f in m.files if f.path.endswith(".safetensors")]),
                                   None)) == 1


def retagged(ckpt: Path, pattern: str, tag: str, **extra: object):
    desc = json.loads((ckpt / DESCRIPTION_NAME).read_text())
    hits = [k for k in desc if pattern in k]
    assert hits
    desc.update(dict.fromkeys(hits, tag), **extra)
    return lambda p: json.dumps(desc).encode() if p == DESCRIPTION_NAME else (ckpt / p).read_bytes()


def test_warnings_on_quantization_tags(ckpt: Path) -> None:
    m = local_manifest(ckpt, REPO)
    [w] = checkpoint_warnings(m, retagged(ckpt, ".mlp.experts.", "W8A8"))
    assert "routed experts are tagged W8A8" in w and "will not load it with --quantization ascend" in w
    [w] = checkpoint_warnings(m, retagged(ckpt, ".mlp.experts.", "W8A8_DYNAMIC"))
    assert "not W4A8_DYNAMIC" in w and "memory" in w
    [w] = checkpoint_warnings(m, retagged(ckpt, ".self_attn.o_proj.", "FLOAT"))
    assert "attention projections" in w and "FLOAT" in w and "not W8A8" in w
    [w] = checkpoint_warnings(m, retagged(ckpt, ".self_attn.kv_b_proj.", "FLOAT", group_size=64))
    assert "group_size 64" in w
    bad = lambda p: b"{not json" if p == DESCRIPTION_NAME else (ckpt / p).read_bytes()  # noqa: E731
    [w] = checkpoint_warnings(m, bad)
    assert DESCRIPTION_NAME in w and "could not be read" in w
