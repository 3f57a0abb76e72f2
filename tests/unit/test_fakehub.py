"""HTTP-level tests of the fake ModelScope/Hugging Face hub (no client libraries)."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote, urlsplit

import pytest

from kimictl.sandbox.checkpoint import checkpoint_manifest, generate_checkpoint
from kimictl.sandbox.fakehub import MALICIOUS_NAMES, FakeHub, Faults, _parse_range

REPO = "Eco-Tech/Kimi-K2.5-W4A8"
SHARD = "quant_model_weights-00001-of-00004.safetensors"
TOKEN = "s3cr3t-token-4b1d"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("ckpt")
    generate_checkpoint(dest, total_bytes=5 * 1024 * 1024, num_shards=4, seed=1)
    return dest


@pytest.fixture
def hub(ckpt: Path) -> Iterator[FakeHub]:
    with FakeHub({REPO: ckpt}) as h:
        yield h


def request(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection; returns what arrived even if the body is cut short."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request(method, u.path + (f"?{u.query}" if u.query else ""), body=body, headers=headers or {})
        resp = conn.getresponse()
        try:
            data = resp.read()
        except http.client.IncompleteRead as exc:
            data = exc.partial
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def ms_file_url(hub: FakeHub, path: str, repo: str = REPO) -> str:
    return f"{hub.url}/api/v1/models/{repo}/repo?Revision=master&FilePath={quote(path, safe='')}"


def ms_listing(hub: FakeHub, query: str = "Revision=master&Recursive=True") -> list[dict]:
    status, _, body = request(f"{hub.url}/api/v1/models/{REPO}/repo/files?{query}")
    assert status == 200
    doc = json.loads(body)
    assert doc["Code"] == 200 and doc["Success"] is True
    return doc["Data"]["Files"]


def hf_tree(hub: FakeHub, rev: str = "main") -> list[dict]:
    """Follow Link rel=next pages until the end."""
    url: str | None = f"{hub.url}/api/models/{REPO}/tree/{rev}?recursive=true&expand=false"
    out: list[dict] = []
    while url:
        status, headers, body = request(url)
        assert status == 200
        out += json.loads(body)
        m = re.search(r'<([^>]+)>;\s*rel="next"', headers.get("link", ""))
        url = m.group(1) if m else None
    return out


# ------------------------------------------------------------------------------------------ ModelScope


def test_ms_listing_reflects_real_files(hub: FakeHub, ckpt: Path) -> None:
    files = ms_listing(hub)
    blobs = {f["Path"]: f for f in files if f["Type"] == "blob"}
    want = {e["path"]: e for e in checkpoint_manifest(ckpt)}
    assert set(blobs) == set(want)
    for path, e in want.items():
        assert blobs[path]["Size"] == e["size"]
        assert blobs[path]["Sha256"] == e["sha256"]
        assert blobs[path]["Name"] == path.rsplit("/", 1)[-1]
        assert re.fullmatch(r"[0-9a-f]{40}", blobs[path]["Revision"])
    assert blobs[SHARD]["IsLFS"] is True and blobs["config.json"]["IsLFS"] is False


def test_ms_listing_non_recursive_and_root(hub: FakeHub) -> None:
    top = ms_listing(hub, "Revision=master")
    assert {"Path": "docs", "Type": "tree"}.items() <= next(f for f in top if f["Path"] == "docs").items()
    assert not any("/" in f["Path"] for f in top)
    sub = ms_listing(hub, "Revision=master&Recursive=True&Root=docs")
    assert [f["Path"] for f in sub] == ["docs/deploy_guidance.md"]


def test_ms_get_full_and_ranges(hub: FakeHub, ckpt: Path) -> None:
    data = (ckpt / SHARD).read_bytes()
    size = len(data)
    status, headers, body = request(ms_file_url(hub, SHARD))
    assert (status, body, headers["content-length"]) == (200, data, str(size))
    status, headers, body = request(ms_file_url(hub, SHARD), headers={"Range": "bytes=100-199"})
    assert (status, body, headers["content-range"]) == (206, data[100:200], f"bytes 100-199/{size}")
    status, headers, body = request(ms_file_url(hub, SHARD), headers={"Range": "bytes=1000-"})
    assert (status, body, headers["content-range"]) == (206, data[1000:], f"bytes 1000-{size - 1}/{size}")
    status, headers, body = request(ms_file_url(hub, SHARD), headers={"Range": "bytes=-10"})
    assert (status, body) == (206, data[-10:])
    status, headers, _ = request(ms_file_url(hub, SHARD), headers={"Range": f"bytes={size}-"})
    assert (status, headers["content-range"]) == (416, f"bytes */{size}")
    status, _, body = request(ms_file_url(hub, "docs/deploy_guidance.md"))
    assert body == (ckpt / "docs" / "deploy_guidance.md").read_bytes()


def test_ms_revisions_and_errors(hub: FakeHub) -> None:
    status, _, body = request(f"{hub.url}/api/v1/models/{REPO}/revisions")
    assert status == 200
    assert json.loads(body)["Data"]["RevisionMap"]["Branches"][0]["Revision"] == "master"
    status, _, body = request(f"{hub.url}/api/v1/models/Nope/Missing/repo/files?Revision=master")
    assert status == 404 and json.loads(body)["Success"] is False
    status, _, body = request(ms_file_url(hub, "missing.json"))
    assert status == 404 and json.loads(body)["Success"] is False
    status, _, _ = request(f"{hub.url}/api/v1/models/{REPO}/repo/files?Revision=v9.9")
    assert status == 404


def test_repo_ids_match_case_insensitively(hub: FakeHub) -> None:
    # vllm-ascend spells the repo "Eco-Tech/Kimi-K2.5-w4a8".
    status, _, _ = request(ms_file_url(hub, "config.json", repo="Eco-Tech/Kimi-K2.5-w4a8"))
    assert status == 200


@pytest.mark.parametrize(
    "path", ["../../../../etc/passwd", "/etc/passwd", "docs/../../x", ".hidden", "docs/../config.json", ""]
)
def test_requests_cannot_escape_repo_dir(hub: FakeHub, path: str) -> None:
    status, _, _ = request(ms_file_url(hub, path))
    assert status == 404
    status, _, _ = request(f"{hub.url}/{REPO}/resolve/main/{path}")
    assert status == 404


# ---------------------------------------------------------------------------------------- Hugging Face


def test_hf_revision_and_tree(ckpt: Path) -> None:
    with FakeHub({REPO: ckpt}, hf_page_size=3) as hub:
        status, _, body = request(f"{hub.url}/api/models/{REPO}/revision/main")
        info = json.loads(body)
        assert status == 200 and info["id"] == REPO and re.fullmatch(r"[0-9a-f]{40}", info["sha"])
        tree = hf_tree(hub, info["sha"])
        hub.wait_idle()
        assert sum(1 for q in hub.requests() if "cursor=" in q["path"]) >= 3
    files = {e["path"]: e for e in tree if e["type"] == "file"}
    want = {e["path"]: e for e in checkpoint_manifest(ckpt)}
    assert set(files) == set(want)
    assert [e["path"] for e in tree if e["type"] == "directory"] == ["docs"]
    sha, size = want[SHARD]["sha256"], want[SHARD]["size"]
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {size}\n"
    assert files[SHARD]["lfs"] == {
        "oid": want[SHARD]["sha256"],
        "size": want[SHARD]["size"],
        "pointerSize": len(pointer),
    }
    assert files[SHARD]["oid"] == hashlib.sha1(b"blob %d\0%s" % (len(pointer), pointer.encode())).hexdigest()
    assert "lfs" not in files["config.json"]
    blob = (ckpt / "config.json").read_bytes()
    assert files["config.json"]["oid"] == hashlib.sha1(b"blob %d\0" % len(blob) + blob).hexdigest()


def test_hf_resolve_headers(hub: FakeHub, ckpt: Path) -> None:
    _, _, body = request(f"{hub.url}/api/models/{REPO}/revision/main")
    commit = json.loads(body)["sha"]
    status, h, body = request(f"{hub.url}/{REPO}/resolve/main/{SHARD}", method="HEAD")
    sha = hashlib.sha256((ckpt / SHARD).read_bytes()).hexdigest()
    size = (ckpt / SHARD).stat().st_size
    assert status == 200 and body == b""
    assert h["x-repo-commit"] == commit
    assert h["etag"] == f'"{sha}"' and h["x-linked-etag"] == f'"{sha}"'
    assert h["x-linked-size"] == h["content-length"] == str(size)
    status, h, body = request(f"{hub.url}/{REPO}/resolve/{commit}/docs/deploy_guidance.md")
    assert status == 200 and body == (ckpt / "docs" / "deploy_guidance.md").read_bytes()
    assert "x-linked-etag" not in h
    status, h, body = request(f"{hub.url}/{REPO}/resolve/main/{SHARD}", headers={"Range": "bytes=8-15"})
    assert status == 206 and body == (ckpt / SHARD).read_bytes()[8:16]


def test_hf_errors(hub: FakeHub) -> None:
    status, h, _ = request(f"{hub.url}/api/models/Org/Nope/revision/main")
    assert status == 404 and h["x-error-code"] == "RepoNotFound"
    status, h, _ = request(f"{hub.url}/{REPO}/resolve/main/nope.bin", method="HEAD")
    assert status == 404 and h["x-error-code"] == "EntryNotFound" and "x-repo-commit" in h
    status, h, _ = request(f"{hub.url}/api/models/{REPO}/revision/v1.0")
    assert status == 404 and h["x-error-code"] == "RevisionNotFound"


def test_listing_follows_file_changes(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{}")
    with FakeHub({REPO: tmp_path}) as hub:
        before = {f["Path"]: f for f in ms_listing(hub)}
        (tmp_path / "a.json").write_text('{"x": 1}')
        (tmp_path / "b.json").write_text("[]")
        after = {f["Path"]: f for f in ms_listing(hub)}
    assert set(after) == {"a.json", "b.json"}
    assert after["a.json"]["Sha256"] == hashlib.sha256(b'{"x": 1}').hexdigest() != before["a.json"]["Sha256"]
    assert after["a.json"]["Revision"] != before["a.json"]["Revision"]


# ---------------------------------------------------------------------------------------------- faults


def test_wrong_sha_only_for_named_files(ckpt: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"wrong_sha": ["config.json", "*-00002-*"]}) as hub:
        files = {f["Path"]: f for f in ms_listing(hub)}
        tree = {e["path"]: e for e in hf_tree(hub)}
    real = {e["path"]: e["sha256"] for e in checkpoint_manifest(ckpt)}
    wrong = {p for p in real if files[p]["Sha256"] != real[p]}
    assert wrong == {"config.json", "quant_model_weights-00002-of-00004.safetensors"}
    assert (
        tree["quant_model_weights-00002-of-00004.safetensors"]["lfs"]["oid"]
        != real["quant_model_weights-00002-of-00004.safetensors"]
    )
    assert tree[SHARD]["lfs"]["oid"] == real[SHARD]


def test_truncate_cuts_every_response(ckpt: Path) -> None:
    data = (ckpt / SHARD).read_bytes()
    with FakeHub({REPO: ckpt}, faults={"truncate": [SHARD]}) as hub:
        for _ in range(2):
            status, h, body = request(ms_file_url(hub, SHARD))
            assert status == 200 and h["content-length"] == str(len(data))
            assert body == data[: len(data) // 2]
        # Resuming past the cut point gets nothing: the file can never be completed.
        status, _, body = request(ms_file_url(hub, SHARD), headers={"Range": f"bytes={len(data) // 2}-"})
        assert status == 206 and body == b""
        status, _, body = request(ms_file_url(hub, "config.json"))
        assert body == (ckpt / "config.json").read_bytes()


def test_drop_first_k_times_then_serves(ckpt: Path) -> None:
    data = (ckpt / SHARD).read_bytes()
    faults = {"drop": {"files": [SHARD], "after": 10_000, "times": 2}}
    with FakeHub({REPO: ckpt}, faults=faults) as hub:
        bodies = [request(f"{hub.url}/{REPO}/resolve/main/{SHARD}")[2] for _ in range(3)]
        assert [len(b) for b in bodies] == [10_000, 10_000, len(data)]
        assert bodies[0] == data[:10_000] and bodies[2] == data
        # A resume after the drop succeeds byte-exactly.
        hub.set_faults({"drop": {"files": [SHARD], "after": 10_000, "times": 1}})
        first = request(ms_file_url(hub, SHARD))[2]
        status, _, rest = request(ms_file_url(hub, SHARD), headers={"Range": f"bytes={len(first)}-"})
        assert status == 206 and first + rest == data


def test_fail_then_succeed(ckpt: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"fail": {"files": ["config.json"], "status": 503, "times": 1}}) as hub:
        assert request(ms_file_url(hub, "config.json"))[0] == 503
        assert request(ms_file_url(hub, "config.json"))[0] == 200


def test_slow_first_byte_delays_headers(ckpt: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"slow_first_byte": {"files": ["config.json"], "delay": 3}}) as hub:
        u = urlsplit(ms_file_url(hub, "config.json"))
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=0.3)
        try:
            conn.request("GET", f"{u.path}?{u.query}")
            with pytest.raises((TimeoutError, socket.timeout)):
                conn.getresponse()
        finally:
            conn.close()
        # The delay only holds back the first byte: a patient client gets the file.
        assert request(ms_file_url(hub, "config.json"))[2] == (ckpt / "config.json").read_bytes()


def test_malicious_names_are_listed_and_served(ckpt: Path) -> None:
    with FakeHub({REPO: ckpt}, faults={"malicious_names": True}) as hub:
        ms = {f["Path"] for f in ms_listing(hub)}
        hf = {e["path"] for e in hf_tree(hub)}
        assert set(MALICIOUS_NAMES) <= ms
        assert set(MALICIOUS_NAMES) <= hf
        assert {"../x", "/etc/passwd", "a\\b"} <= ms
        assert any(any(ord(c) < 32 for c in n) for n in ms)
        status, _, body = request(ms_file_url(hub, "../x"))
        assert status == 200 and body.startswith(b"fakehub:")
    with FakeHub({REPO: ckpt}) as hub:
        assert not set(MALICIOUS_NAMES) & {f["Path"] for f in ms_listing(hub)}


def test_admin_faults_endpoint(hub: FakeHub) -> None:
    status, _, body = request(
        f"{hub.url}/_admin/faults",
        method="POST",
        body=json.dumps({"wrong_sha": ["config.json"]}).encode(),
        headers={"Content-Type": "application/json"},
    )
    assert status == 200 and json.loads(body)["wrong_sha"] == ["config.json"]
    assert hub.faults.wrong_sha == ["config.json"]
    status, _, body = request(f"{hub.url}/_admin/faults")
    assert json.loads(body)["wrong_sha"] == ["config.json"]
    status, _, _ = request(f"{hub.url}/_admin/faults", method="POST", body=b'{"explode": true}')
    assert status == 400
    status, _, _ = request(f"{hub.url}/_admin/faults", method="POST", body=b"not json")
    assert status == 400
    status, _, _ = request(f"{hub.url}/_admin/faults", method="POST", body=b"{}")
    assert status == 200 and hub.faults == Faults()


def test_faults_from_json_forms() -> None:
    f = Faults.from_json(
        {"drop": True, "truncate": "x.bin", "slow_first_byte": {"delay": 0.5}, "drop_times": 3}
    )
    assert (f.drop, f.truncate, f.slow_first_byte, f.slow_delay, f.drop_times) == (
        ["*"],
        ["x.bin"],
        ["*"],
        0.5,
        3,
    )
    with pytest.raises(ValueError):
        Faults.from_json({"nonsense": 1})


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("bytes=0-9", (0, 9)),
        ("bytes=5-", (5, 99)),
        ("bytes=-10", (90, 99)),
        ("bytes=90-500", (90, 99)),
        ("bytes=100-", "unsatisfiable"),
        ("bytes=5-2", "unsatisfiable"),
        ("bytes=0-1,4-5", None),
        ("items=0-1", None),
    ],
)
def test_parse_range(value: str, want: object) -> None:
    assert _parse_range(value, 100) == want


# ---------------------------------------------------------------------------------------------- auth


def test_token_auth(ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kimictl.fakehub")
    with FakeHub({REPO: ckpt}, token=TOKEN) as hub:
        url = ms_file_url(hub, "config.json")
        assert request(url)[0] == 401
        assert request(url, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert request(url, headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert request(url, headers={"Cookie": f"m_session_id={TOKEN}"})[0] == 200
        assert request(url, headers={"Cookie": f"other=1; modelscope_session={TOKEN}"})[0] == 200
        assert request(url, headers={"Cookie": "m_session_id=nope"})[0] == 401
        assert request(f"{hub.url}/{REPO}/resolve/main/config.json", method="HEAD")[0] == 401
        assert request(f"{hub.url}/_admin/stats")[0] == 401
        stats = request(f"{hub.url}/_admin/stats", headers={"Authorization": f"Bearer {TOKEN}"})
        assert stats[0] == 200
        hub.wait_idle()
        dumped = json.dumps(hub.requests()) + stats[2].decode()
        auths = [q["auth"] for q in hub.requests()]
    assert auths.count(None) >= 4 and "bearer" in auths and "cookie:m_session_id" in auths
    assert "config.json" in caplog.text
    assert TOKEN not in caplog.text
    assert TOKEN not in dumped


# ------------------------------------------------------------------------------------- rate and stats


def test_rate_limit_is_shared_across_connections(ckpt: Path) -> None:
    rate = 1_000_000
    data_len = (ckpt / SHARD).stat().st_size
    with FakeHub({REPO: ckpt}, rate=rate) as hub:
        got: list[int] = []

        def pull(offset: int) -> None:
            got.append(
                len(
                    request(ms_file_url(hub, SHARD), headers={"Range": f"bytes={offset}-{offset + 799_999}"})[
                        2
                    ]
                )
            )

        threads = [threading.Thread(target=pull, args=(i * 100_000,)) for i in range(3)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        elapsed = time.monotonic() - start
        assert got == [800_000] * 3 and data_len > 900_000
        # 2.4 MB through a 1 MB/s bucket (plus a 5% burst) cannot finish in under ~2.3 s.
        assert sum(got) / elapsed < rate * 1.25
        status, _, body = request(
            f"{hub.url}/_admin/rate", method="POST", body=json.dumps({"rate": "50MB/s"}).encode()
        )
        assert status == 200 and json.loads(body)["rate"] == 50_000_000 == hub.rate


def test_stats_count_bytes_per_client_and_file(hub: FakeHub, ckpt: Path) -> None:
    size = (ckpt / SHARD).stat().st_size
    request(ms_file_url(hub, SHARD))
    request(f"{hub.url}/{REPO}/resolve/main/{SHARD}", headers={"Range": "bytes=0-999"})
    request(f"{hub.url}/{REPO}/resolve/main/config.json", method="HEAD")
    _, _, body = request(f"{hub.url}/_admin/stats?wait=1")
    stats = json.loads(body)
    client = stats["clients"]["127.0.0.1"]
    assert client["files"] == {f"{REPO}/{SHARD}": size + 1000}
    assert client["requests"] == 3  # the stats request itself is recorded after it is answered
    assert client["bytes"] == size + 1000 == stats["total_bytes"]
    assert request(f"{hub.url}/_admin/stats/reset", method="POST")[0] == 200
    assert hub.stats()["clients"] == {}


# ------------------------------------------------------------------------------------------------- CLI


def test_cli_serves_with_token_and_pidfile(ckpt: Path, tmp_path: Path) -> None:
    (tmp_path / "token").write_text(TOKEN + "\n")
    (tmp_path / "faults.json").write_text('{"malicious_names": true}')
    pidfile, logfile = tmp_path / "hub.pid", tmp_path / "hub.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kimictl.sandbox.fakehub",
            "--repo",
            f"{REPO}={ckpt}",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--rate",
            "100MB/s",
            "--token-file",
            str(tmp_path / "token"),
            "--pidfile",
            str(pidfile),
            "--log-file",
            str(logfile),
            "--faults",
            f"@{tmp_path / 'faults.json'}",
        ],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url)
        assert pidfile.read_text().strip() == str(proc.pid)
        assert request(f"{url}/api/v1/models/{REPO}/repo/files?Revision=master")[0] == 401
        status, _, body = request(
            f"{url}/api/v1/models/{REPO}/repo/files?Revision=master&Recursive=True",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert status == 200 and "../x" in {f["Path"] for f in json.loads(body)["Data"]["Files"]}
        stats = json.loads(request(f"{url}/_admin/stats", headers={"Authorization": f"Bearer {TOKEN}"})[2])
        assert stats["rate"] == 100_000_000
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.returncode == 0
    assert not pidfile.exists()
    text = logfile.read_text()
    assert "/repo/files" in text and " 401 " in text
    assert TOKEN not in text
