"""The hccn_tool bash front and the npu-smi fast `info` answer exactly as the Python doubles, or hand over (no root).

The front is installed twice: with `py` pointing at a sentinel that prints SLOW (to see which calls the
front answers itself) and at the real Python double (end to end, as on a host). The reference answer is
always the Python double's own `main`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from prerequisites import require_or_skip

from kimictl.sandbox import layout
from kimictl.sandbox.cluster import _install_hccn_tool
from kimictl.sandbox.doubles import hccn_tool, npu_smi

FRONT = Path(hccn_tool.__file__).with_name("hccn_tool_front.sh")
SLOW = "SLOW-PATH\n"
SLOW_RC = 99
# the calls kimictl preflight makes (templates/preflight_probe.sh.j2, preflight_ping.sh.j2) must never go slow
PREFLIGHT_QUERIES = ("-link", "-net_health", "-tls", "-ip", "-vnic")

# (hardware, mode, faults) — faults as `sandbox fault` writes them
CASES = {
    "a3-healthy": ("atlas-800-a3", "netns", {}),
    "a2-healthy": ("atlas-800-a2", "netns", {}),
    "a3-faulted": ("atlas-800-a3", "netns", {"npu_unhealthy": [3], "link_down": [5, 15], "port_taken": [8000],
                                            "engine_crash_at_start": ["*"], "driver_version": "23.0.rc3"}),
    "a2-faulted": ("atlas-800-a2", "netns", {"link_down": [0, 7], "engine_hang_in_load": ["decode"]}),
    "a3-loopback-cut": ("atlas-800-a3", "loopback", {"cut_routes": ["127.20.2.0/24", "127.20.9.0/24"],
                                                     "link_down": [2]}),
    "a2-loopback-cut": ("atlas-800-a2", "loopback", {"cut_routes": ["127.20.2.0/24"]}),
}

# a stand-in for iputils ping: canned replies chosen by the destination's last octet, its argv logged
FAKE_PING = r"""#!/bin/bash
printf '%s\n' "$*" >> "${FAKE_PING_LOG:-/dev/null}"
dst=${!#}
echo "PING $dst ($dst) from ${11} : 56(84) bytes of data."
case ${dst##*.} in
1) echo "64 bytes from $dst: icmp_seq=1 ttl=64 time=0.045 ms"
   echo "64 bytes from $dst: icmp_seq=2 ttl=64 time=1.23 ms"
   echo "64 bytes from $dst: icmp_seq=3 ttl=64 time=12.3 ms" ;;
2) echo "64 bytes from $dst: icmp_seq=2 ttl=64 time=123 ms" ;;
3) echo "From $dst icmp_seq=1 Destination Host Unreachable"
   echo "64 bytes from $dst: icmp_seq=2 ttl=64 time=0.5 ms"
   echo "64 bytes from $dst: icmp_seq=3 ttl=64 time=0.071 ms" ;;
4) for s in 1 2 2 3; do echo "64 bytes from $dst: icmp_seq=$s ttl=64 time=0.0$s ms (DUP!)"; done ;;
5) echo "ping: bind: Cannot assign requested address" >&2; exit 2 ;;
*) ;;
esac
echo
echo "--- $dst ping statistics ---"
exit 1
"""


def _host(tmp: Path, hardware: str, mode: str, faults: dict) -> Path:
    h = layout.plan_hosts(3, hardware, mode, 0, tmp / "sb")[0]
    sim = tmp / "sim"
    sim.mkdir(parents=True, exist_ok=True)
    (sim / "host.json").write_text(json.dumps(layout.host_json(h, hardware), indent=2) + "\n")
    (sim / "faults.json").write_text(json.dumps(faults, indent=2) + "\n")
    hccn_tool.write_fast_state(sim)
    return sim


@pytest.fixture
def bins(tmp_path: Path) -> dict[str, Path]:
    """Two installs of the front (sentinel and real Python double) and a fake ping on PATH."""
    sentinel = tmp_path / "sentinel.sh"
    sentinel.write_text(f"#!/bin/sh\nprintf '{SLOW}'\nexit {SLOW_RC}\n")
    sentinel.chmod(0o755)
    fast = tmp_path / "fast-bin" / "hccn_tool"
    fast.parent.mkdir()
    fast.write_text(hccn_tool.front_script(str(sentinel)))
    fast.chmod(0o755)
    _install_hccn_tool(tmp_path / "tools", str(tmp_path / "tools"))
    ping = tmp_path / "pingbin" / "ping"
    ping.parent.mkdir()
    ping.write_text(FAKE_PING)
    ping.chmod(0o755)
    return {"fast": fast, "real": tmp_path / "tools" / "hccn_tool", "pingdir": ping.parent}


def front_calls(tool: Path, sim: Path, calls: list[list[str]], path: str, **env: str) -> list[tuple[int, str]]:
    """(exit code, stdout) of each call of tool, all from one bash process (cheap)."""
    script = "".join(f"{shlex.quote(str(tool))} {shlex.join(c)}; printf '\\n@@rc=%s@@\\n' $?\n" for c in calls)
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True,
                          env={"KIMI_SIM_DIR": str(sim), "PATH": path, **env})
    assert proc.stderr == ""
    parts = proc.stdout.split("@@\n")[:-1]
    out = []
    for p in parts:
        text, _, rc = p.rpartition("\n@@rc=")
        out.append((int(rc), text))
    assert len(out) == len(calls)
    return out


def python_calls(monkeypatch, capsys, sim: Path, calls: list[list[str]], path: str) -> list[tuple[int, str]]:
    monkeypatch.setenv("KIMI_SIM_DIR", str(sim))
    monkeypatch.setenv("PATH", path)
    out = []
    for c in calls:
        capsys.readouterr()
        rc = hccn_tool.main(list(c))
        out.append((rc, capsys.readouterr().out))
    return out


def query_calls(npus: int) -> list[list[str]]:
    cmds = [*hccn_tool.FAST_QUERIES, "-bogus", "-ping", "-hccs_ping"]
    # the NPUs the faults above name, the ends, and one past the end
    return [["-i", str(n), c, "-g"] for n in sorted({0, 1, 2, 3, 5, 7, npus - 1, npus}) for c in cmds]


@pytest.mark.parametrize("case", list(CASES))
def test_queries_match_the_python_double(case, tmp_path, bins, monkeypatch, capsys):
    hardware, mode, faults = CASES[case]
    sim = _host(tmp_path, hardware, mode, faults)
    npus = layout.HARDWARE[hardware].npus
    calls = query_calls(npus)
    want = python_calls(monkeypatch, capsys, sim, calls, "/usr/bin:/bin")
    fast = front_calls(bins["fast"], sim, calls, "/usr/bin:/bin")
    # end to end as installed on a host (front, then the Python double for what it does not answer)
    ends = [i for i, c in enumerate(calls) if c[1] in ("0", str(npus - 1), str(npus))]
    assert front_calls(bins["real"], sim, [calls[i] for i in ends], "/usr/bin:/bin") == [want[i] for i in ends]
    a3 = hardware == "atlas-800-a3"
    for call, w, f in zip(calls, want, fast, strict=True):
        if f == (SLOW_RC, SLOW):
            # only what the front cannot answer goes slow: bad NPU ids, unknown or argument-less commands
            assert int(call[1]) == npus or call[2] in ("-bogus", "-ping", "-hccs_ping"), call
        else:
            assert f == w, call
        if int(call[1]) < npus and (call[2] in PREFLIGHT_QUERIES[:4] or (call[2] == "-vnic" and a3)):
            assert f == w and w[0] == 0, call
    down = set(faults.get("link_down", []))
    assert [(c[1], w[1]) for c, w in zip(calls, want, strict=True) if c[2] == "-link" and int(c[1]) < npus] == \
        [(str(n), f"link status: {'DOWN' if n in down else 'UP'}\n") for n in sorted({0, 1, 2, 3, 5, 7, npus - 1})]


def ping_calls(hardware: str, mode: str) -> list[list[str]]:
    peer = layout.plan_hosts(3, hardware, mode, 0, Path("/x"))[1].device_ips[0]   # atlas-02, npu 0
    base = ".".join(peer.split(".")[:3])
    other = "127.20.3" if mode == "loopback" else "10.201.3"
    dsts = [f"{base}.{i}" for i in range(1, 7)] + [f"{other}.{i}" for i in (1, 2, 4)]
    calls = []
    for n in (0, 2, 5, 7, 15):
        for cmd in ("-ping", "-hccs_ping"):
            calls += [["-i", str(n), cmd, "-g", "address", d] for d in dsts]
    return calls


@pytest.mark.parametrize("case", list(CASES))
def test_pings_match_the_python_double(case, tmp_path, bins, monkeypatch, capsys):
    hardware, mode, faults = CASES[case]
    sim = _host(tmp_path, hardware, mode, faults)
    npus = layout.HARDWARE[hardware].npus
    calls = [c for c in ping_calls(hardware, mode) if int(c[1]) < npus]
    path = f"{bins['pingdir']}:/usr/bin:/bin"
    log_py, log_fast = tmp_path / "py.log", tmp_path / "fast.log"
    monkeypatch.setenv("FAKE_PING_LOG", str(log_py))
    want = python_calls(monkeypatch, capsys, sim, calls, path)
    fast = front_calls(bins["fast"], sim, calls, path, FAKE_PING_LOG=str(log_fast))
    a3 = hardware == "atlas-800-a3"
    for call, w, f in zip(calls, want, fast, strict=True):
        if call[2] == "-hccs_ping" and not a3:
            assert f == (SLOW_RC, SLOW) and w[0] == 1 and "Unsupported" in w[1]
        else:
            assert f == w, call
    # the same real pings ran with the same arguments, and the canned replies exercised every branch
    assert log_fast.read_text() == log_py.read_text() != ""
    if "cut_routes" in faults:
        return
    outs = "".join(w[1] for w in want)
    for text in ("3 received, 0.00%", "1 received, 66.67%", "2 received, 33.33%", "4 received, -33.33%",
                 "0 received, 100.00%", "time=0.045000ms", "time=123.000000ms", "recv seq=1,time=0.500000ms"):
        assert text in outs, text


def test_malformed_addresses_with_cut_routes_go_to_the_python_double(tmp_path, bins, monkeypatch, capsys):
    sim = _host(tmp_path, "atlas-800-a3", "loopback", {"cut_routes": ["127.20.2.0/24"]})
    path = f"{bins['pingdir']}:/usr/bin:/bin"
    calls = [["-i", "0", "-ping", "-g", "address", d] for d in ("127.20.2.256", "127.20.2", "localhost", "0127.1.1.1")]
    fast = front_calls(bins["fast"], sim, calls, path)
    assert fast == [(SLOW_RC, SLOW)] * len(calls)
    assert front_calls(bins["real"], sim, calls, path) == python_calls(monkeypatch, capsys, sim, calls, path)
    # without cut routes the front pings any plain address itself, as the double would
    sim = _host(tmp_path / "b", "atlas-800-a3", "loopback", {})
    calls = [["-i", "0", "-ping", "-g", "address", d] for d in ("127.20.2.256", "localhost")]
    assert front_calls(bins["fast"], sim, calls, path) == python_calls(monkeypatch, capsys, sim, calls, path)


@pytest.mark.parametrize("argv", [[], ["-i"], ["-i", "0", "-link"], ["-i", "0", "-link", "-g", "x"],
                                  ["-i", "00", "-link", "-g"], ["-i", "+1", "-link", "-g"], ["-i", "0", "-link", "-s"],
                                  ["-link", "-g", "-i", "0"], ["-i", "0", "-ip", "-g", "address", "1.2.3.4"],
                                  ["-i", "0", "-ping", "-g", "addr", "1.2.3.4"], ["-i", "0", "-LINK", "-g"],
                                  ["-i", "0", "-ping", "-g", "address", ""],
                                  ["-i", "0", "-ping", "-g", "address", "$(id)"],
                                  ["-i", "0", "-ip", "-g", "-g"], ["-i", "../npu1", "-ip", "-g"]])
def test_other_argument_shapes_go_to_the_python_double(argv, tmp_path, bins, monkeypatch, capsys):
    sim = _host(tmp_path, "atlas-800-a3", "netns", {"link_down": [0]})
    assert front_calls(bins["fast"], sim, [argv], "/usr/bin:/bin") == [(SLOW_RC, SLOW)]
    assert front_calls(bins["real"], sim, [argv], "/usr/bin:/bin") == \
        python_calls(monkeypatch, capsys, sim, [argv], "/usr/bin:/bin")


def test_stale_or_missing_state_goes_to_the_python_double(tmp_path, bins, monkeypatch, capsys):
    sim = _host(tmp_path, "atlas-800-a3", "netns", {})
    calls = [["-i", "5", "-link", "-g"], ["-i", "5", "-net_health", "-g"]]
    assert front_calls(bins["fast"], sim, calls, "/usr/bin:/bin") == [(0, "link status: UP\n"),
                                                                       (0, "net health status: Success\n")]
    stale = [(SLOW_RC, SLOW)] * 2

    def both_agree():
        assert front_calls(bins["fast"], sim, calls, "/usr/bin:/bin") == stale
        assert front_calls(bins["real"], sim, calls, "/usr/bin:/bin") == \
            python_calls(monkeypatch, capsys, sim, calls, "/usr/bin:/bin")

    # faults.json changed behind the sandbox's back: the front no longer trusts its fast state
    (sim / "faults.json").write_text('{"link_down": [5]}\n')
    both_agree()
    assert front_calls(bins["real"], sim, calls, "/usr/bin:/bin")[0] == (0, "link status: DOWN\n")
    hccn_tool.write_fast_state(sim)   # what `sandbox fault` does after writing faults.json
    assert front_calls(bins["fast"], sim, calls, "/usr/bin:/bin") == [(0, "link status: DOWN\n"),
                                                                       (0, "net health status: Fault\n")]
    # a NUL byte after the JSON the answers were rendered from
    (sim / "faults.json").write_bytes((sim / "faults.json").read_bytes() + b"\0junk")
    both_agree()
    (sim / "faults.json").unlink()
    both_agree()
    hccn_tool.write_fast_state(sim)   # a missing faults.json reads as {} in both
    assert front_calls(bins["fast"], sim, calls, "/usr/bin:/bin")[0] == (0, "link status: UP\n")
    (sim / "fast" / "npu5").unlink()
    both_agree()
    hccn_tool.write_fast_state(sim)
    (sim / "host.json").write_text(json.dumps({**json.loads((sim / "host.json").read_text()), "npus": 4}))
    both_agree()
    hccn_tool.write_fast_state(sim)   # fewer NPUs: the files of the others go away
    assert sorted(p.name for p in (sim / "fast").iterdir()) == ["npu-smi", "npu0", "npu1", "npu2", "npu3"]
    both_agree()   # npu5 is now out of range: an error only the double prints
    (sim / "host.json").unlink()
    both_agree()
    hccn_tool.write_fast_state(sim)   # no host.json: no fast state at all
    assert list((sim / "fast").iterdir()) == []


def test_unusual_json_gets_no_fast_answers(tmp_path):
    good = json.dumps(layout.host_json(layout.plan_hosts(1, "atlas-800-a2", "netns", 0, tmp_path)[0],
                                       "atlas-800-a2")).encode()
    assert hccn_tool.fast_state(b"", b"{}") == {}
    assert hccn_tool.fast_state(good.replace(b"atlas-01", "atlas-\u00e9".encode()), b"{}") == {}   # not ASCII
    assert hccn_tool.fast_state(good, b'{"link_down": "5"}')[0].count(b"\0q") == 0   # the double raises
    files = hccn_tool.fast_state(good, b'{"cut_routes": ["10.0.0.0/33"]}')   # would raise in the double
    assert b"\0p-ping=" not in files[0] and b"\0q-link=0:link status: UP\n\0" in files[0]
    assert hccn_tool.cut_pairs(["10.1.0.0/16", "10.2.3.4"]) == [(0x0A010000, 0xFFFF0000), (0x0A020304, 0xFFFFFFFF)]
    assert hccn_tool.cut_pairs(["10.1.0.0/", "10.1.0"]) is None


def test_front_is_valid_bash_and_real_ping_works(tmp_path, bins, monkeypatch, capsys):
    assert subprocess.run(["bash", "-n", str(FRONT)], check=False).returncode == 0
    assert FRONT.read_text().count("@HCCN_TOOL_PY@") == 1
    probe = subprocess.run(["ping", "-n", "-c", "1", "-W", "1", "-I", "127.0.0.1", "127.0.0.1"],
                           capture_output=True, check=False)
    if probe.returncode != 0:
        require_or_skip("no usable ping to 127.0.0.1 here")
    sim = tmp_path / "sim"
    sim.mkdir()
    host = layout.host_json(layout.plan_hosts(1, "atlas-800-a3", "loopback", 0, tmp_path)[0], "atlas-800-a3")
    host["device_ips"] = ["127.0.0.1"] * 16
    (sim / "host.json").write_text(json.dumps(host))
    (sim / "faults.json").write_text(json.dumps({"cut_routes": ["127.0.0.2/32"]}))
    hccn_tool.write_fast_state(sim)
    calls = [["-i", "0", "-hccs_ping", "-g", "address", d] for d in ("127.0.0.1", "127.0.0.2")]
    fast = front_calls(bins["fast"], sim, calls, "/usr/bin:/bin")
    want = python_calls(monkeypatch, capsys, sim, calls, "/usr/bin:/bin")
    assert [rc for rc, _ in fast] == [rc for rc, _ in want] == [0, 1]
    assert fast[1] == want[1]

    def shape(text: str) -> list[str]:
        return [ln.split(",time=")[0] + (",time=" if ",time=" in ln else "") for ln in text.splitlines()]

    assert shape(fast[0][1]) == shape(want[0][1])
    assert shape(fast[0][1])[-1] == "3 packets transmitted, 3 received, 0.00% packet loss"


def test_fast_file_cut_short_goes_to_the_python_double(tmp_path, bins):
    sim = _host(tmp_path, "atlas-800-a3", "netns", {})
    call = [["-i", "2", "-link", "-g"]]
    assert front_calls(bins["fast"], sim, call, "/usr/bin:/bin") == [(0, "link status: UP\n")]
    f = sim / "fast" / "npu2"
    assert f.read_bytes().endswith(b"\0end=1\0")
    f.write_bytes(f.read_bytes()[: -len(b"end=1\0")])
    assert front_calls(bins["fast"], sim, call, "/usr/bin:/bin") == [(SLOW_RC, SLOW)]


# npu-smi: `info` is answered from fast/npu-smi (rendered next to hccn_tool's files) while it is still true

def _npu_smi(sim: Path, *args: str) -> tuple[int, str]:
    proc = subprocess.run(["python3", str(Path(npu_smi.__file__)), *args], capture_output=True, text=True,
                          env={"KIMI_SIM_DIR": str(sim), "PATH": "/usr/bin:/bin"}, check=False)
    return proc.returncode, proc.stdout


def _npu_smi_reference(monkeypatch, capsys, sim: Path, *args: str) -> tuple[int, str]:
    """The Python double's own answer, with the fast path off."""
    monkeypatch.setenv("KIMI_SIM_DIR", str(sim))
    with monkeypatch.context() as m:
        m.setattr(npu_smi, "fast_info", lambda: None)
        capsys.readouterr()
        rc = npu_smi.main(list(args))
        return rc, capsys.readouterr().out


@pytest.mark.parametrize("case", list(CASES))
def test_npu_smi_fast_info_matches_the_python_double(case, tmp_path, monkeypatch, capsys):
    hardware, mode, faults = CASES[case]
    sim = _host(tmp_path, hardware, mode, faults)
    (sim / "claims").mkdir()
    assert (sim / "fast" / "npu-smi").exists()
    want = _npu_smi_reference(monkeypatch, capsys, sim, "info")
    monkeypatch.undo()
    assert npu_smi.fast_info() is None   # KIMI_SIM_DIR is not this sim here
    monkeypatch.setenv("KIMI_SIM_DIR", str(sim))
    assert npu_smi.fast_info() == want[1] and want[0] == 0
    assert _npu_smi(sim, "info") == want
    if faults.get("npu_unhealthy"):
        assert "Critical" in want[1]


def test_npu_smi_fast_info_only_while_true(tmp_path, monkeypatch, capsys):
    sim = _host(tmp_path, "atlas-800-a3", "netns", {})
    (sim / "claims").mkdir()
    monkeypatch.setenv("KIMI_SIM_DIR", str(sim))
    assert npu_smi.fast_info() is not None
    # faults.json changed behind the sandbox's back
    (sim / "faults.json").write_text('{"npu_unhealthy": [3]}\n')
    assert npu_smi.fast_info() is None
    assert "Critical" in _npu_smi(sim, "info")[1]
    hccn_tool.write_fast_state(sim)
    assert "Critical" in npu_smi.fast_info()
    # a claimed NPU shows in the table: the double answers (a live claim, this test's own pid)
    (sim / "claims" / "npu4").write_text(f"{os.getpid()}\n")
    assert npu_smi.fast_info() is None
    assert _npu_smi(sim, "info") == _npu_smi_reference(monkeypatch, capsys, sim, "info")
    assert "No running processes found in NPU 2" not in _npu_smi(sim, "info")[1]
    (sim / "claims" / "npu4").unlink()
    assert npu_smi.fast_info() is not None
    # other commands never use it
    assert _npu_smi(sim, "info", "-t", "health", "-i", "1", "-c", "1")[1].count("Critical") == 1
    # host.json changed, a NUL byte, a missing file, a file cut short: no fast answer
    good = (sim / "host.json").read_bytes()
    (sim / "host.json").write_bytes(good.replace(b'"hbm_mb": 65536', b'"hbm_mb": 32768'))
    assert npu_smi.fast_info() is None and "32768" in _npu_smi(sim, "info")[1]
    (sim / "host.json").write_bytes(good + b"\0")
    assert npu_smi.fast_info() is None
    (sim / "host.json").write_bytes(good)
    assert npu_smi.fast_info() is not None
    fast = sim / "fast" / "npu-smi"
    fast.write_bytes(fast.read_bytes()[: -len(b"end=1\0")])
    assert npu_smi.fast_info() is None
    fast.unlink()
    assert npu_smi.fast_info() is None
    # nothing to pre-render (no host.json): no file, and the double's own error
    (sim / "host.json").unlink()
    hccn_tool.write_fast_state(sim)
    assert not fast.exists()
    assert _npu_smi(sim, "info")[0] != 0
