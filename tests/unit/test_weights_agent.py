"""The host side of `kimictl weights` (agent.py) in-process, and the control side's pure parts (stage.py)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest

from kimictl.errors import InvalidInput
from kimictl.remote import weights_agent as agent_mod
from kimictl.remote.weights_agent import Agent, file_digest, rsync_serve, unsafe_name
from kimictl.sandbox.checkpoint import checkpoint_manifest, generate_checkpoint
from kimictl.weights.manifest import local_manifest, unsafe_reason
from kimictl.weights.stage import HubQueue, agent_command, read_token


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    generate_checkpoint(d, total_bytes=5 << 20, num_shards=3, seed=5)
    return d


@pytest.fixture
def manifest(ckpt):
    return json.loads(local_manifest(ckpt, model_id="Eco-Tech/Kimi-K2.5-W4A8").to_json())


class Talk:
    """An agent on a temp model dir; events are read back from its output."""

    def __init__(self, model_dir: Path):
        self.out = io.StringIO()
        self.agent = Agent(str(model_dir), out=self.out)
        self.seen = 0

    def events(self) -> list[dict]:
        lines = self.out.getvalue().splitlines()
        new, self.seen = lines[self.seen:], len(lines)
        return [json.loads(x) for x in new]

    def hello(self, manifest: dict, mode: str = "stamps", **kw) -> dict:
        self.agent.op_hello({"manifest": manifest, "digest": "d1", "mode": mode, **kw})
        (ev,) = self.events()
        return ev


def test_names_refused_by_agent_and_manifest_agree():
    bad = ["/etc/passwd", "../x", "a/../../b", "a\\b", "ctl\x01", "new\nline", "./x", "a//b", "~root/x", "",
           "x" * 256]
    for name in bad:
        assert unsafe_name(name), name
        assert unsafe_reason(name), name
    for name in ["config.json", "docs/deploy_guidance.md", "a.b/c-d_e.safetensors", "..hidden-but-fine"]:
        assert unsafe_name(name) is None and unsafe_reason(name) is None, name


def test_hello_reports_missing_then_ok_and_stamps_spare_rereads(tmp_path, ckpt, manifest):
    t = Talk(tmp_path / "m")
    ev = t.hello(manifest)
    assert ev["ev"] == "state" and sorted(ev["missing"]) == sorted(f["path"] for f in manifest["files"])
    shutil.copytree(ckpt, tmp_path / "m", dirs_exist_ok=True)
    first = t.hello(manifest)
    assert not first["missing"] and not first["bad"] and first["bytes_read"] > 0
    again = t.hello(manifest)
    assert again["bytes_read"] == 0 and len(again["have"]) == len(manifest["files"])
    assert t.hello(manifest, mode="full")["bytes_read"] == first["bytes_read"]
    # status mode reads nothing, even for a file without a stamp
    (tmp_path / "m" / agent_mod.STAMPS).unlink()
    status = Talk(tmp_path / "m").hello(manifest, mode="stat")
    assert status["bytes_read"] == 0 and len(status["unverified"]) == len(manifest["files"])


def test_flipped_byte_is_bad_and_pull_removes_it_and_the_marker(tmp_path, ckpt, manifest):
    shutil.copytree(ckpt, tmp_path / "m")
    t = Talk(tmp_path / "m")
    t.hello(manifest)
    (tmp_path / "m" / agent_mod.MARKER).write_text(json.dumps({"digest": "d1"}))
    assert t.hello(manifest)["complete"]
    shard = sorted(p.name for p in (tmp_path / "m").glob("*.safetensors"))[1]
    with open(tmp_path / "m" / shard, "r+b") as f:
        f.seek(1000)
        b = f.read(1)
        f.seek(1000)
        f.write(bytes([b[0] ^ 0x40]))
    ev = t.hello(manifest, invalidate=True)
    assert ev["bad"] == [shard] and not ev["complete"]
    assert not (tmp_path / "m" / agent_mod.MARKER).exists()
    ev = t.hello(manifest, pull=True, holder={"what": "test"})
    assert not (tmp_path / "m" / shard).exists()


def test_adopt_installs_only_matching_bytes_and_finish_writes_marker_last(tmp_path, ckpt, manifest):
    t = Talk(tmp_path / "m")
    t.hello(manifest, pull=True, holder={})
    push = tmp_path / "m" / agent_mod.STAGING / "push"
    for f in manifest["files"]:
        (push / f["path"]).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ckpt / f["path"], push / f["path"])
    victim = manifest["files"][0]["path"]
    (push / victim).write_bytes(b"x" * manifest["files"][0]["size"])
    t.agent.op_finish({})
    assert t.events()[-1]["ev"] == "error"   # nothing in place yet: no marker
    for f in manifest["files"]:
        t.agent.op_adopt({"path": f["path"]})
    evs = t.events()
    fails = [e for e in evs if e["ev"] == "fail"]
    assert [e["path"] for e in fails] == [victim] and "mismatch" in fails[0]["error"]
    assert not (push / victim).exists() and not (tmp_path / "m" / victim).exists()
    assert not (tmp_path / "m" / agent_mod.MARKER).exists()
    shutil.copyfile(ckpt / victim, push / victim)
    t.agent.op_adopt({"path": victim})
    t.agent.op_finish({})
    assert t.events()[-1] == {"ev": "complete", "digest": "d1"}
    marker = json.loads((tmp_path / "m" / agent_mod.MARKER).read_text())
    assert marker["digest"] == "d1" and marker["files"] == len(manifest["files"])
    assert not (tmp_path / "m" / agent_mod.STAGING).exists()
    assert {f["path"]: f["sha256"] for f in checkpoint_manifest(tmp_path / "m")} == \
        {f["path"]: f["sha256"] for f in manifest["files"]}


def test_second_agent_meets_the_lock_with_its_holder(tmp_path, manifest):
    first = Talk(tmp_path / "m")
    first.hello(manifest, pull=True, holder={"what": "weights pull", "user": "ana", "host": "ctl-1"})
    second = Talk(tmp_path / "m")
    ev = second.hello(manifest, pull=True, holder={})
    assert ev["ev"] == "locked" and ev["holder"]["user"] == "ana" and ev["holder"]["pid"] == os.getpid()
    os.close(first.agent.lock_fd)   # the holder goes away: the lock goes with it
    assert Talk(tmp_path / "m").hello(manifest, pull=True, holder={})["ev"] == "state"


def test_git_blob_sha1_for_hf_small_files(tmp_path):
    p = tmp_path / "config.json"
    p.write_bytes(b"hello\n")
    assert file_digest(p, "git_sha1") == "ce013625030ba8dba906f756967f9e9ca394464a"   # `git hash-object`


def test_events_never_carry_the_token(tmp_path, manifest):
    t = Talk(tmp_path / "m")
    t.agent.secrets.append("tok-abc")
    t.agent.emit(ev="fail", path="x", via="hub", error="401 for Bearer tok-abc")
    assert "tok-abc" not in t.out.getvalue()


@pytest.mark.parametrize(("command", "ok"), [
    ("rsync --server --sender -e.LsfxCIvu . quant_model_weights-00001-of-00003.safetensors", True),
    ("rsync --server --sender -e.LsfxCIvu --timeout=60 . docs/deploy_guidance.md", True),
    ("rsync --server -e.LsfxCIvu . config.json", False),            # a receiver would write
    ("rsync --server --sender -e.LsfxCIvu . ../../etc/shadow", False),
    ("rsync --server --sender -e.LsfxCIvu . /etc/shadow", False),
    ("rsync --server --sender --remove-source-files . config.json", False),
    ("sh -c id", False),
    ("", False),
])
def test_peer_key_only_serves_read_only_rsync_inside_the_model_dir(monkeypatch, tmp_path, command, ok):
    ran = []
    monkeypatch.setenv("SSH_ORIGINAL_COMMAND", command)
    monkeypatch.setattr(os, "execvp", lambda prog, argv: ran.append((prog, argv, os.getcwd())) or 0)
    monkeypatch.chdir(tmp_path)
    rc = rsync_serve(str(tmp_path))
    assert bool(ran) == ok
    if not ok:
        assert rc == 1
    else:
        assert ran[0][2] == str(tmp_path) and ran[0][1][:3] == ["rsync", "--server", "--sender"]


def test_hub_queue_keeps_every_host_pulling_until_no_file_is_left():
    """No share is fixed up front: whichever host's hub pull lands first takes the next file (largest first), so a
    slow host never leaves the hub serving only its own remaining files; each file is handed out exactly once."""
    size = {f"f{i}": s for i, s in enumerate([10, 100, 10, 90, 1, 80, 5, 70])}
    q = HubQueue(list(size), size)
    first = {h: q.take(h) for h in ("a", "b", "c")}
    assert first == {"a": ("f1", 0), "b": ("f3", 0), "c": ("f5", 0)}
    assert q.take("a") is None   # one hub pull per host at a time (HUB_STREAMS)
    handed = [p for p, _ in first.values()]
    q.landed("b", "f3")   # b is fast: it takes the next files while a and c are still on their first
    for _ in range(3):
        took = q.take("b")
        assert took is not None and q.pulling("b") == {took[0]: 0}
        handed.append(took[0])
        q.landed("b", took[0])
    assert handed[3:] == ["f7", "f0", "f2"]   # largest first; equal sizes in manifest order
    assert q.pulling("a") == {"f1": 0} and q.pulling("c") == {"f5": 0}
    q.landed("a", "f1")
    handed.append(q.take("a")[0])
    assert handed[-1] == "f6" and q.take("c") is None   # c still pulls f5
    q.landed("c", "f5")
    handed.append(q.take("c")[0])
    assert q.take("b") is None and q.take("c") is None   # nothing left to hand out
    assert sorted(handed) == sorted(size) and len(handed) == len(set(handed))


def test_hub_queue_lanes_never_share_a_download_area():
    size = {"x": 3, "y": 2, "z": 1}
    q = HubQueue(list(size), size, per_host=2)
    assert [q.take("a"), q.take("a"), q.take("a")] == [("x", 0), ("y", 1), None]
    q.landed("a", "x")
    assert q.take("a") == ("z", 0)   # the lane x freed, not one y still downloads into


def test_agent_boots_from_stdin_without_being_installed(tmp_path, ckpt, manifest):
    import subprocess

    cmd = agent_command("python3", str(tmp_path / "m"))
    src = json.dumps(Path(agent_mod.__file__).read_text())
    hello = json.dumps({"op": "hello", "manifest": manifest, "digest": "d", "mode": "stat"})
    out = subprocess.run(["sh", "-c", cmd], input=f"{src}\n{hello}\n", capture_output=True, text=True, timeout=30,
                         check=False)
    ev = json.loads(out.stdout.splitlines()[0])
    assert ev["ev"] == "state" and len(ev["missing"]) == len(manifest["files"]), out.stderr
    assert not (tmp_path / "m").exists()   # status/verify change nothing on a host without a checkpoint


def test_token_file_must_be_private(tmp_path, monkeypatch):
    f = tmp_path / "tok"
    f.write_text("secret\n")
    f.chmod(0o640)
    with pytest.raises(InvalidInput, match="chmod 600"):
        read_token("modelscope", f)
    f.chmod(0o600)
    assert read_token("modelscope", f) == "secret"
    monkeypatch.setenv("HF_TOKEN", "hf-tok")
    assert read_token("huggingface", None) == "hf-tok"
    monkeypatch.delenv("MODELSCOPE_API_TOKEN", raising=False)
    assert read_token("modelscope", None) is None


def test_forced_command_serves_before_the_agents_imports_and_keeps_escaped_names(tmp_path):
    """The peer key's forced command runs once per transfer, so it must not pay for the agent's imports; names
    that rsync backslash-escapes still reach rsync whole, and refusals are the same as in-process."""
    import subprocess

    bin_dir, model = tmp_path / "bin", tmp_path / "m"
    bin_dir.mkdir()
    model.mkdir()
    fake = bin_dir / "rsync"   # stands in for rsync: shows what it was started with, and where
    fake.write_text('#!/bin/sh\npwd\nfor a in "$@"; do echo "[$a]"; done\n')
    fake.chmod(0o755)

    def serve(command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["python3", "-I", "-S", "-X", "importtime", agent_mod.__file__, "rsync-serve",
                               str(model)], capture_output=True, text=True, timeout=30, check=False,
                              env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command})

    ok = serve("rsync --server --sender -e.LsfxCIvu --timeout=60 . config.json a\\ b/c\\ d.json")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [str(model), "[--server]", "[--sender]", "[-e.LsfxCIvu]", "[--timeout=60]",
                                      "[.]", "[config.json]", "[a b/c d.json]"]
    for heavy in ("concurrent.futures", "subprocess", "hashlib", "json"):
        assert f"| {heavy}\n" not in ok.stderr, heavy
    for bad in ("rsync --server --sender -e.LsfxCIvu . a\x0bb", "rsync --server --sender -e.x . a/\\.\\./b",
                "rsync --server --sender --timeout=6x . config.json", "rsync --server --sender . 'a'\"b\"/../x"):
        refused = serve(bad)
        assert refused.returncode == 1 and not refused.stdout, bad
        assert "refused rsync arguments" in refused.stderr
