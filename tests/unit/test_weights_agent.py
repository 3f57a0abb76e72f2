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
from kimictl.remote.weights_agent import Agent, file_digest, parse_peer_command, rsync_serve, unsafe_name
from kimictl.sandbox.checkpoint import checkpoint_manifest, generate_checkpoint
from kimictl.weights.manifest import local_manifest, unsafe_reason
from kimictl.weights.stage import agent_command, read_token


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
    # each file says its bytes are in before it is hashed: the control node starts the next transfer meanwhile
    for f in manifest["files"]:
        assert [e["ev"] for e in evs if e.get("path") == f["path"]] == \
            ["received", "fail" if f["path"] == victim else "done"]
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


GOOD = "rsync --server --sender -Re.LsfxCIvu --timeout=60 . "


@pytest.mark.parametrize(("command", "ok"), [
    (GOOD + "quant_model_weights-00001-of-00003.safetensors", True),
    (GOOD + "docs/deploy_guidance.md config.json", True),
    ("rsync --server --sender -Re31.14iLsfxC --timeout=60 . config.json", True),   # a pre-release protocol
    (GOOD + "dir/a\\ b.json", True),   # rsync >= 3.2.4 backslash-escapes names
    # options of any kind, wherever they stand: --log-file appends to any file as root (-> code execution)
    ("rsync --server --sender -Re.LsfxCIvu --timeout=60 --log-file=/tmp/x . config.json", False),
    (GOOD + "--log-file=/tmp/x config.json", False),   # after '.', rsync still reads options
    (GOOD + "config.json --log-file=/tmp/x --log-file-format=%f", False),
    ("rsync --server --sender -Re.LsfxCIvu --timeout=60 --log-file /tmp/x . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu --log-file=/tmp/x --timeout=60 . config.json", False),
    ("rsync --server --sender -e.LsfxCIvu --timeout=60 . config.json", False),       # not kimictl's flags
    ("rsync --server --sender -vRe.LsfxCIvu --timeout=60 . config.json", False),
    ("rsync --server --sender -RMe.Lsf --timeout=60 . config.json", False),
    ("rsync --server --sender -Re.Lsf/x --timeout=60 . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu --timeout=600 . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu --timeout=60 --remove-source-files . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu --timeout=60 'x' . config.json", False),
    ("rsync --server --sender -Re.LsfxCIvu --timeout=60 .", False),                   # no name
    ("rsync --server -Re.LsfxCIvu --timeout=60 . config.json", False),                # a receiver would write
    # names that leave the model directory
    (GOOD + "../../etc/shadow", False),
    (GOOD + "/etc/shadow", False),
    (GOOD + "a/../../b", False),
    (GOOD + "a/./b", False),
    (GOOD + "~root/.ssh/id_rsa", False),
    (GOOD + "a\x0bb", False),
    (GOOD + "'a'\"b\"/../x", False),
    (GOOD + "'unterminated", False),
    ("sh -c id", False),
    ("", False),
])
def test_peer_key_runs_only_kimictls_own_read_only_rsync(monkeypatch, tmp_path, command, ok):
    ran = []
    monkeypatch.setenv("SSH_ORIGINAL_COMMAND", command)
    monkeypatch.setattr(os, "execvpe", lambda prog, argv, env: ran.append((prog, argv, os.getcwd(), env)) or 0,
                        raising=False)
    monkeypatch.setattr(os, "execvp", lambda prog, argv: ran.append((prog, argv, os.getcwd(), None)) or 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    log = tmp_path / "logs" / "weights-peer.log"
    rc = rsync_serve(str(tmp_path / "m"), str(log))
    assert bool(ran) == ok, ran
    if ok:
        _, argv, cwd, env = ran[0]
        assert cwd == str(tmp_path / "m")
        assert argv[:6] == ["rsync", "--server", "--sender", argv[3], "--timeout=60", "."]
        assert env == {"PATH": os.environ["PATH"]}   # nothing else from the SSH session reaches rsync
        assert not log.exists()
    else:
        assert rc == 1
        assert "refused rsync arguments" in log.read_text()   # the refusal leaves a trace on the host
        assert oct(log.stat().st_mode & 0o777) == "0o600"


def test_peer_key_parser_accepts_exactly_what_kimictls_fetch_sends(tmp_path):
    """The forced command and the fetch must agree: run the real rsync client with peer_fetch_command's options
    and hand what it would send to the holder to the parser."""
    import subprocess

    fake_ssh = tmp_path / "ssh"
    # rsync runs `ssh -l USER HOST WORDS...`; sshd joins the words with spaces into SSH_ORIGINAL_COMMAND
    fake_ssh.write_text(f'#!/bin/sh\nshift 3\nprintf %s "$*" > {tmp_path}/sent\nexit 1\n')
    fake_ssh.chmod(0o755)
    op = {"paths": ["config.json", "sub dir/w-00001.safetensors", "x'y.json"], "key": str(tmp_path / "k"),
          "known_hosts": str(tmp_path / "kh"), "peer": {"name": "h2", "address": "10.0.0.2", "port": 22,
                                                       "user": "root"}}
    cmd = agent_mod.peer_fetch_command(op, tmp_path / "dst")
    cmd[cmd.index("-e") + 1] = str(fake_ssh)
    subprocess.run(cmd, capture_output=True, timeout=30, check=False)
    sent = (tmp_path / "sent").read_text()
    argv, why = parse_peer_command(sent)
    assert argv is not None, (sent, why)
    assert argv[6:] == op["paths"]


def test_peer_key_line_is_limited_to_the_cluster_and_expires(tmp_path, monkeypatch):
    """The line kimictl installs: restrict, from= the hosts' addresses, the forced command, an expiry the host's
    sshd reads in its own time; renewing moves only the expiry."""
    import time
    from types import SimpleNamespace

    from kimictl.weights.stage import Stager

    monkeypatch.setenv("HOME", str(tmp_path))
    links = {"h1": SimpleNamespace(address="10.0.0.1"), "h3": SimpleNamespace(address="10.0.0.3")}
    stager = SimpleNamespace(peer_sources={"10.0.0.2", "10.0.0.1"}, links=links, key_comment="kimictl-weights:c1",
                             c=SimpleNamespace(kimi_python="python3", kimi_model_dir="/m"))
    line = Stager.authorized_line(stager, "/var/lib/kimi", "ssh-ed25519 AAAA kimictl-weights:c1")
    assert line.startswith('restrict,from="10.0.0.1,10.0.0.2,10.0.0.3",command="python3 -I -S '
                           '/var/lib/kimi/weights/kimi_weights_agent.py rsync-serve /m '
                           '/var/lib/kimi/logs/weights-peer.log" ssh-ed25519 AAAA kimictl-weights:c1')
    agent_mod.install_peer_key({"key_dir": str(tmp_path / "kd"), "model_dir": str(tmp_path / "m"),
                                "agent_src": "#", "peer_key": "k", "known_hosts": "", "key_comment":
                                "kimictl-weights:c1", "authorized_line": line})
    keys = tmp_path / ".ssh" / "authorized_keys"
    (installed,) = keys.read_text().splitlines()
    want = time.strftime("%Y%m%d%H%M", time.localtime(time.time() + agent_mod.KEY_TTL_S))
    assert installed.startswith(f'restrict,expiry-time="{want}') and 'from="10.0.0.1,' in installed
    assert oct(keys.stat().st_mode & 0o777) == "0o600"
    agent_mod.renew_peer_key("kimictl-weights:c1", time.time() + 2 * agent_mod.KEY_TTL_S)
    (renewed,) = keys.read_text().splitlines()
    later = time.strftime("%Y%m%d%H%M", time.localtime(time.time() + 2 * agent_mod.KEY_TTL_S))
    assert f'expiry-time="{later}' in renewed and renewed.count("expiry-time") == 1
    assert renewed.split('",', 1)[1] == installed.split('",', 1)[1]


PLANTED = '10.0.0.1"\nssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIattacker attacker\nrestrict,from="10.0.0.9'


def _stager(**kw):
    """A Stager with only the attributes hello and the peer key's line use (no SSH, no hosts)."""
    import queue
    from types import SimpleNamespace

    from kimictl.weights.stage import HostReport, Stager

    st = object.__new__(Stager)
    st.m, st.digest, st.targets = SimpleNamespace(to_json=lambda: "{}"), "d1", {}
    st.state_dir = {"h1": "/var/lib/kimi", "h2": "/var/lib/kimi"}
    st.key_comment, st.peer_sources, st.events = "kimictl-weights:c1", set(), queue.Queue()
    st.c = SimpleNamespace(kimi_python="python3", kimi_model_dir="/m")
    st.reports = {h: HostReport(h) for h in ("h1", "h2")}
    st.links = {h: SimpleNamespace(address=a, send=lambda op: None) for h, a in (("h1", "10.0.0.1"),
                                                                                 ("h2", "10.0.0.2"))}
    st.__dict__.update(kw)
    return st


@pytest.mark.parametrize("source", [PLANTED, "fe80::1%x\"\nssh-ed25519 AAAA x", "10.0.0.1 ", "host.example", 167772161,
                                    "10.0.0.0/8", ""])
def test_a_source_address_that_is_not_an_ip_literal_refuses_the_host_before_any_key_is_written(source):
    """Issue 27: a host's agent reports the addresses it connects from; they become the peer key's from= on every
    host. One holding a quote and a line break would plant a key line of its own everywhere: the host is refused
    at hello (before the key is made or installed), its value shown as data."""
    from types import SimpleNamespace

    from kimictl.errors import HostError

    st = _stager()
    st.events.put(("h1", {"ev": "state", "sources": ["10.0.0.1"]}))
    st.events.put(("h2", {"ev": "state", "sources": ["10.0.0.2", source]}))
    with pytest.raises(HostError) as err:
        st._open(SimpleNamespace(errors=dict, sessions={}), "stamps", pull=True)
    assert err.value.host == "h2" and repr(source)[:40] in err.value.message
    assert "\n" not in err.value.render()
    assert st.peer_sources == {"10.0.0.1"}


def test_source_addresses_are_kept_in_their_canonical_form():
    from kimictl.weights.stage import peer_sources

    assert peer_sources("h1", ["10.0.0.1", "::FFFF:10.0.0.2", "fd00::0001"]) == {"10.0.0.1", "::ffff:a00:2",
                                                                                 "fd00::1"}
    assert peer_sources("h1", None) == set()


def test_the_peer_key_line_is_refused_on_the_control_node_and_on_the_host(tmp_path, monkeypatch):
    """Defence in depth: were a planted value to reach the line, the control node refuses to build it and the
    host's installer refuses to write it; authorized_keys is left as it was."""
    from kimictl.errors import KimictlError

    with pytest.raises(KimictlError, match="refusing to install the peer key"):
        _stager(peer_sources={PLANTED}).authorized_line("/var/lib/kimi", "ssh-ed25519 AAAA kimictl-weights:c1")
    monkeypatch.setenv("HOME", str(tmp_path))
    keys = tmp_path / ".ssh" / "authorized_keys"
    keys.parent.mkdir()
    keys.write_text("ssh-ed25519 BBBB admin@desk\n")
    good = _stager().authorized_line("/var/lib/kimi", "ssh-ed25519 AAAA kimictl-weights:c1")
    payload = {"key_dir": str(tmp_path / "kd"), "model_dir": str(tmp_path / "m"), "agent_src": "#", "peer_key": "k",
               "known_hosts": "", "key_comment": "kimictl-weights:c1"}
    bad_lines = [good.replace("10.0.0.1", PLANTED), good.replace("10.0.0.1", "10.0.0.1 10.0.0.3"),
                 good.replace("rsync-serve", "rsync-serve\r"), good.replace("rsync-serve", "rsync-serve\0"),
                 good.replace(" /m ", " /m\t"), good.replace(" /m ", "  /m "), good.replace(" /m ", ' /m\\" '),
                 good.replace(" /m ", " /m\u2028"), good + "\n", good + " x", good.replace("c1", "c2"),
                 good.replace("restrict,", "")]
    for line in bad_lines:
        with pytest.raises(ValueError, match="refusing to write"):
            agent_mod.install_peer_key({**payload, "authorized_line": line})
        assert keys.read_text() == "ssh-ed25519 BBBB admin@desk\n", line
    agent_mod.install_peer_key({**payload, "authorized_line": good})
    assert keys.read_text().splitlines()[0] == "ssh-ed25519 BBBB admin@desk"


def test_cleanup_removes_every_line_kimictl_wrote_and_only_those(tmp_path, monkeypatch):
    """The key's line goes on a line of its own (a last key without a newline is not run on), and removing it
    leaves every other key, even one whose comment merely ends in kimictl's."""
    monkeypatch.setenv("HOME", str(tmp_path))
    comment = "kimictl-weights:c1"
    keys = tmp_path / ".ssh" / "authorized_keys"
    keys.parent.mkdir()
    others = f"ssh-ed25519 CCCC ops-{comment}\nssh-ed25519 BBBB admin@desk"
    keys.write_text(others)   # no newline at the end
    line = _stager().authorized_line("/var/lib/kimi", f"ssh-ed25519 AAAA {comment}")
    agent_mod.authorize(comment, agent_mod.with_expiry(line, 2e9))
    lines = keys.read_text().splitlines()
    assert lines[:2] == others.splitlines() and lines[2].startswith('restrict,expiry-time="') and len(lines) == 3
    assert agent_mod.peer_key_lines(comment) == [lines[2]]
    agent_mod.authorize(comment, None)
    assert keys.read_text() == others + "\n"


def test_the_playbooks_cleanup_removes_the_keys_line_and_leaves_the_others(tmp_path, monkeypatch):
    """weights.yml (cleanup), for when the agents could not remove the key themselves: a real local run."""
    import sys

    from kimictl.ansible import build_run_spec, run_playbook

    monkeypatch.setenv("HOME", str(tmp_path))
    comment = "kimictl-weights:c1"
    keys = tmp_path / ".ssh" / "authorized_keys"
    keys.parent.mkdir()
    others = f"ssh-ed25519 CCCC ops-{comment}\nssh-ed25519 BBBB admin@desk\n"
    line = _stager().authorized_line("/var/lib/kimi", f"ssh-ed25519 AAAA {comment}")
    keys.write_text(others.replace("\n", f"\n{agent_mod.with_expiry(line, 2e9)}  \n", 1))
    (tmp_path / "sd" / "weights").mkdir(parents=True)
    inventory = tmp_path / "inv.yml"
    inventory.write_text(f"all:\n  hosts:\n    local1:\n      ansible_connection: local\n"
                         f"      ansible_python_interpreter: {sys.executable}\n")
    res = run_playbook(build_run_spec(tmp_path / "run", "weights.yml", inventory, {"kimi": {
        "phase": "cleanup", "cluster": "c1", "state_dir_of": {"local1": str(tmp_path / "sd")}}}, ident="01-cleanup",
        hosts=["local1"]))
    assert res.ok, res.failures
    assert keys.read_text() == others and not (tmp_path / "sd" / "weights").exists()


def test_stale_peer_key_is_removed_and_reported_unless_a_pull_holds_it(tmp_path, manifest, monkeypatch):
    """A killed run leaves its key behind: the next hello (status, verify, pull) removes it and says so; the key
    of a pull that is running (it holds the directory's lock) is reported, never removed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    comment = "kimictl-weights:c1"
    keys = tmp_path / ".ssh" / "authorized_keys"

    def install() -> None:
        (tmp_path / "kd").mkdir(exist_ok=True)
        keys.parent.mkdir(exist_ok=True)
        keys.write_text("ssh-ed25519 BBBB admin@desk\n"
                        f'restrict,expiry-time="20300102030405",command="x" ssh-ed25519 AAAA {comment}\n')

    key_op = {"key_comment": comment, "key_dir": str(tmp_path / "kd")}
    assert Talk(tmp_path / "m").hello(manifest, mode="stat", key_comment="kimictl-weights:other")["peer_key"] is None
    running = Talk(tmp_path / "m")
    running.hello(manifest, pull=True, holder={"what": "weights pull", "user": "ana"}, **key_op)
    install()   # what the pull's prepare step does
    ev = Talk(tmp_path / "m").hello(manifest, mode="stat", **key_op)
    assert ev["peer_key"]["state"] == "in use" and ev["peer_key"]["holder"]["user"] == "ana"
    assert ev["peer_key"]["expires"] == "2030-01-02 03:04:05" and comment in keys.read_text()
    os.close(running.agent.lock_fd)   # the pull was killed
    ev = Talk(tmp_path / "m").hello(manifest, mode="stat", **key_op)
    assert ev["peer_key"] == {"state": "removed", "expires": "2030-01-02 03:04:05", "lines": 1}
    assert keys.read_text() == "ssh-ed25519 BBBB admin@desk\n" and not (tmp_path / "kd").exists()
    assert Talk(tmp_path / "m").hello(manifest, mode="stat", **key_op)["peer_key"] is None
    install()   # a new pull finds a dead run's key: it is not its own, so it goes
    ev = Talk(tmp_path / "m").hello(manifest, pull=True, holder={}, **key_op)
    assert ev["peer_key"]["state"] == "removed" and comment not in keys.read_text()


def test_agent_boots_from_stdin_without_being_installed(tmp_path, ckpt, manifest, host_python):
    import subprocess

    cmd = agent_command(host_python, str(tmp_path / "m"))
    src = json.dumps(Path(agent_mod.__file__).read_text())

    def hello(mode: str) -> dict:
        op = json.dumps({"op": "hello", "manifest": manifest, "digest": "d", "mode": mode})
        out = subprocess.run(["sh", "-c", cmd], input=f"{src}\n{op}\n", capture_output=True, text=True, timeout=30,
                             check=False)
        return json.loads(out.stdout.splitlines()[0]) if out.stdout else {"stderr": out.stderr}

    ev = hello("stat")
    assert ev.get("ev") == "state" and len(ev["missing"]) == len(manifest["files"]), ev
    assert not (tmp_path / "m").exists()   # status/verify change nothing on a host without a checkpoint
    shutil.copytree(ckpt, tmp_path / "m")   # the host's python3 (the floor's in scripts/test.sh) hashes them
    ev = hello("full")
    assert ev.get("ev") == "state" and sorted(ev["have"]) == sorted(f["path"] for f in manifest["files"]), ev


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


@pytest.mark.parametrize(("make", "why"), [
    (lambda p: p.mkdir(mode=0o700), "is not a regular file"),
    (lambda p: (p.write_text(""), p.chmod(0o600)), "is empty"),
    (lambda p: None, "No such file"),
    (lambda p: (p.write_text("tok1\ntok2\n"), p.chmod(0o600)), "holds 2 words or lines"),
    (lambda p: (p.write_text("t" * (2 << 20)), p.chmod(0o600)), "not a key or token"),
])
def test_token_file_that_holds_no_token_is_named(tmp_path, make, why):
    f = tmp_path / "tok"
    make(f)
    with pytest.raises(InvalidInput, match=f"--token-file {f}.*{why}"):
        read_token("modelscope", f)


def test_forced_command_serves_before_the_agents_imports_and_keeps_escaped_names(tmp_path, host_python):
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
        return subprocess.run([host_python, "-I", "-S", "-X", "importtime", agent_mod.__file__, "rsync-serve",
                               str(model), str(tmp_path / "refused.log")], capture_output=True, text=True, timeout=30,
                              check=False, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command})

    ok = serve("rsync --server --sender -Re.LsfxCIvu --timeout=60 . config.json a\\ b/c\\ d.json")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines() == [str(model), "[--server]", "[--sender]", "[-Re.LsfxCIvu]", "[--timeout=60]",
                                      "[.]", "[config.json]", "[a b/c d.json]"]
    for heavy in ("concurrent.futures", "subprocess", "hashlib", "json"):
        assert f"| {heavy}\n" not in ok.stderr, heavy
    for bad in (GOOD + "a\x0bb", GOOD + "a/\\.\\./b", "rsync --server --sender -Re.x --timeout=6x . config.json",
                GOOD + "'a'\"b\"/../x", GOOD + "--log-file=/tmp/x config.json"):
        refused = serve(bad)
        assert refused.returncode == 1 and not refused.stdout, bad
        assert "refused rsync arguments" in refused.stderr
    assert len((tmp_path / "refused.log").read_text().splitlines()) == 5


def _write_like_rsync(dest: Path, data: bytes, chunks: int = 8, rename: bool = True, follow=None) -> Path:
    """What rsync's receiver does: a temp file next to dest, written front to back, renamed at the end. With
    `follow`, the rest waits until the follower found the temp file (on a busy machine its thread may start late)."""
    import time

    tmp = dest.parent / f".{dest.name}.Ab12Cd"
    step = len(data) // chunks + 1
    with open(tmp, "wb") as f:
        for i in range(0, len(data), step):
            f.write(data[i:i + step])
            f.flush()
            if follow is not None:
                assert follow.opened.wait(30), "the follower never found rsync's temp file"
            time.sleep(0.01)
    if rename:
        os.replace(tmp, dest)
    return tmp


def test_a_peer_file_is_hashed_while_it_arrives_and_not_read_again(tmp_path, monkeypatch):
    import hashlib
    import threading

    data = os.urandom(3 << 20)
    dest = tmp_path / "d" / "shard.safetensors"
    dest.parent.mkdir()
    follow = agent_mod._Follow(dest, len(data), "sha256")
    writer = threading.Thread(target=_write_like_rsync, args=(dest, data), kwargs={"follow": follow})
    writer.start()
    writer.join()
    follow.stop()
    assert follow.digest_of(dest) == hashlib.sha256(data).hexdigest()

    t = Talk(tmp_path / "m")
    t.agent.manifest = {"shard.safetensors": {"path": "shard.safetensors", "size": len(data),
                                              "sha256": hashlib.sha256(data).hexdigest()}}

    def no_second_read(*a):
        raise AssertionError("the file was read again")
    monkeypatch.setattr(agent_mod, "file_digest", no_second_read)
    t.agent._install("shard.safetensors", dest, "atlas-02", 0.0, follow)
    assert [e["ev"] for e in t.events()] == ["received", "done"]
    assert (tmp_path / "m" / "shard.safetensors").read_bytes() == data


def test_what_was_followed_counts_only_for_the_same_whole_file(tmp_path):
    data = os.urandom(1 << 20)
    dest = tmp_path / "x.bin"
    short = agent_mod._Follow(dest, len(data) + 1, "sha256")   # rsync ended before the whole size came
    _write_like_rsync(dest, data)
    short.stop()
    assert short.digest_of(dest) is None
    other = agent_mod._Follow(dest.with_name("y.bin"), len(data), "sha256")
    tmp = _write_like_rsync(dest.with_name("y.bin"), data, rename=False)
    dest.with_name("y.bin").write_bytes(data)   # another file ends up at the destination
    other.stop()
    assert other.digest_of(dest.with_name("y.bin")) is None
    tmp.unlink()
    nothing = agent_mod._Follow(tmp_path / "never.bin", 10, "sha256")
    nothing.stop()   # no temp file ever showed up: it is hashed after all
    assert nothing.digest_of(tmp_path / "never.bin") is None


def test_a_pull_clears_the_temp_files_a_killed_agent_left(tmp_path, manifest):
    (tmp_path / "m").mkdir()
    stale = tmp_path / "m" / f".{agent_mod.STAMPS}.tmp4242"
    stale.write_text("{}")
    Talk(tmp_path / "m").hello(manifest, mode="stat")   # verify/status change nothing
    assert stale.exists()
    Talk(tmp_path / "m").hello(manifest, pull=True, holder={})
    assert not stale.exists()


def test_agent_refuses_a_model_dir_others_may_write(tmp_path, manifest):
    """The agent runs as root: a model dir that group or others may write (or that another user owns) lets them
    plant symlinks it would follow, so a pull refuses it before writing anything."""
    d = tmp_path / "models"
    d.mkdir()
    d.chmod(0o777)
    t = Talk(d)
    ev = t.hello(manifest, pull=True)
    assert ev["ev"] == "error" and "writable by group or others (mode 777" in ev["message"], ev
    assert not (d / agent_mod.LOCK).exists()
    d.chmod(0o755)
    assert agent_mod.untrusted_dir(d) == ""
    if os.geteuid() == 0:   # another owner: only root can make one
        os.chown(d, 12345, -1)
        assert "owned by uid 12345" in agent_mod.untrusted_dir(d)


def test_agent_follows_no_symlink_planted_in_the_model_dir(tmp_path):
    d = tmp_path / "models"
    d.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (d / agent_mod.LOCK).symlink_to(victim)
    with pytest.raises(OSError):
        agent_mod.try_lock(d / agent_mod.LOCK, {"who": "test"})
    # the stamps file's temp name, planted as a symlink: removed and written afresh, never written through
    (d / f".{agent_mod.STAMPS}.tmp{os.getpid()}").symlink_to(victim)
    agent_mod._atomic_write(d / agent_mod.STAMPS, "{}")
    assert victim.read_text() == "keep me\n"
    assert json.loads((d / agent_mod.STAMPS).read_text()) == {}
    assert not (d / agent_mod.STAMPS).is_symlink()
