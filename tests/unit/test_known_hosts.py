"""Host keys: known_hosts parsed as OpenSSH reads it (markers, hashed and wildcard names), revoked and changed keys
refused, unknown hosts named, and new keys appended safely by parallel connections (threads and processes)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import multiprocessing
import os
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import paramiko
import pytest

from kimictl import known_hosts
from kimictl.inventory import load_inventory
from kimictl.ssh import Session, SSHError, Target, ansible_host_key_args, target_for

CA_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDKU1pVvVmTq2QOV2l7Hz7vrbQJb6+UyxyuPJ6jTz4vE"
OLD_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB5mOw2CR1vNmn9n3fRC5Hqnh2AdQRwqW4bOzhn1Fdc2"
HEAD = ("# the team's known hosts\n"
        f"@cert-authority *.corp.example {CA_KEY} ca\n"
        f"old.example.com,10.9.9.9 {OLD_KEY} old\n"
        "\n"
        "# keep me too\n"
        "not a valid line\n"
        "@bogus-marker x ssh-ed25519 AAAA\n")


def keypair(path: Path) -> paramiko.Ed25519Key:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return paramiko.Ed25519Key.from_private_key_file(str(path))


def line(name: str, key: paramiko.PKey) -> str:
    return f"{name} {key.get_name()} {key.get_base64()}\n"


class _Server(paramiko.ServerInterface):
    def get_allowed_auths(self, username):
        return "publickey"

    def check_auth_publickey(self, username, key):
        return paramiko.AUTH_SUCCESSFUL


class FakeSSHD:
    """A paramiko SSH server on loopback that accepts any public key (host key checking is what is tested)."""

    def __init__(self, host_key: paramiko.PKey):
        self.host_key = host_key
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            t = paramiko.Transport(conn)
            t.add_server_key(self.host_key)
            self.transports.append(t)
            try:
                t.start_server(server=_Server())
            except (paramiko.SSHException, EOFError, OSError):
                continue

    def close(self) -> None:
        self.sock.close()
        for t in self.transports:
            t.close()


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    return {"client": d / "client", **{f"host{i}": keypair(d / f"host{i}") for i in range(8)},
            "_": keypair(d / "client")}


@pytest.fixture(scope="module")
def sshds(keys):
    servers = [FakeSSHD(keys[f"host{i}"]) for i in range(8)]
    yield servers
    for s in servers:
        s.close()


def target(sshd: FakeSSHD, keys, kh: Path, *, name: str = "atlas-01", strict: bool = True) -> Target:
    return Target(name=name, address="127.0.0.1", port=sshd.port, key_files=(str(keys["client"]),),
                  known_hosts=(str(kh),), strict=strict, global_known_hosts=())


def test_parse_reads_markers_hashed_and_wildcard_names_and_skips_bad_lines(tmp_path):
    salt = os.urandom(20)
    digest = hmac.new(salt, b"[10.0.0.5]:2222", hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    text = HEAD + f"{hashed} {OLD_KEY}\n@revoked * {CA_KEY}\n*.lab,!bad.lab {CA_KEY}\n" \
                  "wrong.type ssh-rsa " + OLD_KEY.split()[1] + "\n"
    entries = known_hosts.parse(text, "kh")
    assert [e.marker for e in entries] == ["@cert-authority", "", "", "@revoked", ""]
    assert entries[0].matches("web.corp.example") and not entries[0].matches("corp.example.org")
    assert entries[1].matches("10.9.9.9") and entries[1].matches("OLD.example.com") and entries[1].where == "kh:3"
    assert entries[2].matches("[10.0.0.5]:2222") and not entries[2].matches("10.0.0.5")
    assert entries[4].matches("a.lab") and not entries[4].matches("bad.lab")


def test_check_refuses_revoked_and_changed_keys_and_names_unknown_hosts(tmp_path, keys):
    k0, k1 = keys["host0"], keys["host1"]
    kh = tmp_path / "known_hosts"
    kh.write_text(HEAD + line("[10.0.0.1]:22", k0) + line("10.0.0.1", k0) + f"@revoked 10.0.0.2 {line('', k1)[1:]}")
    files = (str(kh),)
    b64 = k0.get_base64()
    assert known_hosts.check("atlas-01", "10.0.0.1", "ssh-ed25519", b64, files, (), accept_new=False) == "known"
    with pytest.raises(known_hosts.HostKeyError, match=r"atlas-01 \(10.0.0.1\) has CHANGED.*known_hosts:9"):
        known_hosts.check("atlas-01", "10.0.0.1", "ssh-ed25519", k1.get_base64(), files, (), accept_new=True)
    with pytest.raises(known_hosts.HostKeyError, match=r"atlas-02 \(10.0.0.2\) offers .* @revoked in .*:10"):
        known_hosts.check("atlas-02", "10.0.0.2", "ssh-ed25519", k1.get_base64(), files, (), accept_new=True)
    with pytest.raises(known_hosts.HostKeyError, match=r"unknown host key for atlas-03 \(10.0.0.3, ssh-ed25519 "
                                                       r"SHA256:.*--accept-new-host-keys"):
        known_hosts.check("atlas-03", "10.0.0.3", "ssh-ed25519", b64, files, (), accept_new=False)
    with pytest.raises(known_hosts.HostKeyError, match=r"@cert-authority\) covers it.*plain key"):
        known_hosts.check("web", "web.corp.example", "ssh-ed25519", b64, files, (), accept_new=False)
    # the global file (/etc/ssh/ssh_known_hosts) counts; a new key goes to the first user file only
    glob = tmp_path / "ssh_known_hosts"
    glob.write_text(line("10.0.0.4", k0))
    assert known_hosts.check("atlas-04", "10.0.0.4", "ssh-ed25519", b64, files, (str(glob),),
                             accept_new=False) == "known"
    assert known_hosts.check("atlas-03", "10.0.0.3", "ssh-ed25519", b64, files, (str(glob),),
                             accept_new=True) == "added"
    assert kh.read_text().endswith(line("10.0.0.3", k0)) and glob.read_text() == line("10.0.0.4", k0)


def _append_many(path: str, start: int, n: int, b64: str) -> None:
    for i in range(start, start + n):
        known_hosts.append(Path(path), f"[10.1.0.{i % 250}]:{2000 + i}", "ssh-ed25519", b64)


def test_parallel_writers_keep_every_key_and_every_byte(tmp_path, keys):
    kh = tmp_path / "known_hosts"
    kh.write_text(HEAD.rstrip("\n"))   # no final newline: the first append must not glue onto the last line
    b64 = keys["host0"].get_base64()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda s: _append_many(str(kh), s, 10, b64), range(0, 160, 10)))
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_append_many, args=(str(kh), s, 20, b64)) for s in range(160, 320, 20)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    text = kh.read_text()
    assert text.startswith(HEAD)
    added = text[len(HEAD):].splitlines()
    assert sorted(added) == sorted(f"[10.1.0.{i % 250}]:{2000 + i} ssh-ed25519 {b64}" for i in range(320))
    assert known_hosts.append(kh, "[10.1.0.3]:2003", "ssh-ed25519", b64) is False   # already there: no duplicate


def test_parallel_connections_learn_every_host_key_and_keep_the_file(tmp_path, keys, sshds):
    kh = tmp_path / "known_hosts"
    kh.write_text(HEAD)

    def connect(sshd: FakeSSHD) -> None:
        Session(target(sshd, keys, kh, name=f"atlas-{sshd.port}"), accept_new_keys=True).connect().close()

    with ThreadPoolExecutor(len(sshds)) as pool:
        list(pool.map(connect, sshds))
    text = kh.read_text()
    assert text.startswith(HEAD)
    assert sorted(text[len(HEAD):].splitlines()) == sorted(line(f"[127.0.0.1]:{s.port}", s.host_key).strip()
                                                           for s in sshds)
    # OpenSSH reads what was written: ssh-keygen finds each host in the file
    for s in sshds[:2]:
        found = subprocess.run(["ssh-keygen", "-F", f"[127.0.0.1]:{s.port}", "-f", str(kh)], capture_output=True,
                               text=True, check=False)
        assert s.host_key.get_base64() in found.stdout
    # learnt once, known from then on, also without the flag
    Session(target(sshds[0], keys, kh)).connect().close()
    assert kh.read_text() == text


def test_unknown_revoked_and_changed_keys_are_refused_before_login(tmp_path, keys, sshds):
    s0, s1 = sshds[0], sshds[1]
    kh = tmp_path / "known_hosts"
    kh.write_text(HEAD)
    with pytest.raises(SSHError, match=rf"unknown host key for atlas-01 \(\[127.0.0.1\]:{s0.port}.*"
                                       "--accept-new-host-keys"):
        Session(target(s0, keys, kh)).connect()
    assert kh.read_text() == HEAD
    kh.write_text(HEAD + f"@revoked * {line('', s0.host_key)[1:]}")
    with pytest.raises(SSHError, match=r"atlas-01 .*@revoked"):
        Session(target(s0, keys, kh), accept_new_keys=True).connect()
    kh.write_text(HEAD + line(f"[127.0.0.1]:{s1.port}", s0.host_key))
    with pytest.raises(SSHError, match=r"atlas-02 .*has CHANGED"):
        Session(target(s1, keys, kh, name="atlas-02"), accept_new_keys=True).connect()
    # an inventory that turns strict checking off learns the key like --accept-new-host-keys
    Session(target(s0, keys, tmp_path / "fresh", strict=False)).connect().close()
    assert (tmp_path / "fresh").read_text() == line(f"[127.0.0.1]:{s0.port}", s0.host_key)


def test_ansible_gets_the_same_known_hosts_and_policy(tmp_path):
    inv_path = tmp_path / "inv.yml"
    inv_path.write_text(
        "all:\n  vars:\n    kimi_cluster: c\n    kimi_model_dir: /m\n    kimi_nic: eth0\n"
        "    ansible_ssh_common_args: -o UserKnownHostsFile=/s/known_hosts -o StrictHostKeyChecking=yes\n"
        "  hosts:\n    h1: {ansible_host: 10.0.0.1, kimi_hardware: atlas-800-a3}\n"
        "    h2: {ansible_host: 10.0.0.2, kimi_hardware: atlas-800-a3}\n")
    inv = load_inventory(inv_path)
    assert target_for(inv.hosts[0]).global_known_hosts == known_hosts.GLOBAL_FILES
    assert ansible_host_key_args(inv, False) == "-o UserKnownHostsFile=/s/known_hosts"
    assert ansible_host_key_args(inv, True) == \
        "-o UserKnownHostsFile=/s/known_hosts -o StrictHostKeyChecking=accept-new"
