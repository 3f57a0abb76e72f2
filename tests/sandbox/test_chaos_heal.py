"""The unattended healer outlives the faults it exists for (issue 34's chaos run), on the 4-host A3 sandbox (a3-pd =
2P2D behind kimictl's proxy front with an API key, the deployment of test_rollout_slices).

Eight client threads send non-streaming completions through the proxy the whole time while `kimictl status --watch 5
--heal` runs, and faults come one after another, each once the cluster is healthy again: `kill -9` of a decode
engine, a decode engine that hangs while running (`engine-hang-now`), `kill -9` of a prefill engine, a decode host
that goes down (every process on it gone, sshd included) and comes back as after a reboot (nothing of kimictl's
runs), and a decode engine out of KV cache (`kv-pressure`). The watch never exits; the cluster ends healthy with the
downed host's engines serving again; no client request fails: the front sends a request whose router failed before
any byte reached the client once more, to another router copy.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import kimictl

from tests.sandbox.test_lease_run import Proc
from tests.sandbox.test_rollout_slices import API_KEY, Load, _state_dir, _supervised, cluster

pytestmark = pytest.mark.sandbox
__all__ = ["cluster"]  # the deployment this module shares with test_rollout_slices (module-scoped fixture)


def _why(st: dict) -> str:
    """What keeps a status document from healthy, in a few lines."""
    sick = [(e["id"], e["state"], e.get("detail")) for e in st.get("engines", []) if e.get("state") != "ready"]
    proxy = st.get("proxy") or {}
    return (f"state {st.get('state')}; engines not ready: {sick}; proxy {proxy.get('state')}, membership "
            f"{[(m.get('router'), m.get('missing'), m.get('error')) for m in proxy.get('membership') or []]}; "
            f"pairs {[(p.get('state'), p.get('detail')) for p in st.get('pairs', [])]}; drift {st.get('drift')}")


def _open_actions(events: Path) -> list[str]:
    """Heal actions started and not ended (the watch is acting on them now)."""
    evs = [json.loads(x) for x in events.read_text().splitlines() if x.strip()] if events.exists() else []
    started = {e["id"]: e["slice"] for e in evs if e.get("event") == "action" and e.get("result") == "started"}
    ended = {e["id"] for e in evs if e.get("event") == "action" and e.get("result") != "started"}
    return [s for i, s in started.items() if i not in ended]


def _healthy(inv: str, timeout: float, settle: float = 8, watch: Proc | None = None,
             events: Path | None = None) -> dict:
    """Wait `settle` seconds (the fault takes effect), then until status is healthy and the heal watch acts on
    nothing, twice in a row more than one watch interval apart (a round that was detecting has acted by then)."""
    time.sleep(settle)
    deadline = time.monotonic() + timeout
    st: dict = {}
    calm = 0
    while time.monotonic() < deadline:
        proc = kimictl("status", "-i", inv, "--output", "json", timeout=300)
        st = json.loads(proc.stdout) if proc.stdout.strip() else {}
        ok = proc.returncode == 0 and st.get("state") == "healthy" and not (events and _open_actions(events))
        calm = calm + 1 if ok else 0
        if calm == 2:
            return st
        time.sleep(6)
    seen = "".join(watch.stderr)[-4000:] + "\n" + "".join(watch.stdout)[-3000:] if watch else ""
    rc = watch.p.poll() if watch else None
    raise AssertionError(f"not healthy within {timeout}s: {_why(st)}\nthe heal watch (rc {rc}) printed:\n{seen}")


def _kill9(sb, role: str, host: str) -> int:
    sup = _supervised(sb)
    key = next(k for k in sorted(sup) if k.startswith(f"{host}:{role}-"))
    pid = sup[key]["child_pid"]
    sb.ssh(host, f"kill -9 {pid}")
    return pid


def test_the_heal_watch_outlives_a_chaos_run_with_no_client_error(cluster) -> None:
    sb = cluster
    inv = str(sb.inventory)
    decode = sorted({e["host"] for e in sb.engines if e["role"] == "decode"})
    prefill = sorted({e["host"] for e in sb.engines if e["role"] == "prefill"})
    lock_host = min(sb.hosts)
    assert len(decode) == 2 and lock_host not in decode
    events = _state_dir(sb) / "heal-events.jsonl"
    seen = len(events.read_text().splitlines()) if events.exists() else 0
    _healthy(inv, 300, settle=0)

    load = Load(f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions", threads=8, api_key=API_KEY).start()
    watch = Proc([sys.executable, "-m", "kimictl", "status", "-i", inv, "--watch", "5", "--heal"])
    steps: list[tuple[str, float]] = []
    try:
        t = time.monotonic()
        _kill9(sb, "decode", decode[0])
        _healthy(inv, 300, watch=watch, events=events)
        steps.append(("kill -9 decode", time.monotonic() - t))

        t = time.monotonic()
        sb.fault(f"engine-hang-now:{decode[1]}:decode")
        # hung: token counters flat for the hang deadline (20 s) while requests run
        _healthy(inv, 300, settle=30, watch=watch, events=events)
        sb.fault(f"clear:{decode[1]}")
        steps.append(("hang decode", time.monotonic() - t))

        t = time.monotonic()
        _kill9(sb, "prefill", prefill[-1])
        _healthy(inv, 300, watch=watch, events=events)
        steps.append(("kill -9 prefill", time.monotonic() - t))

        t = time.monotonic()
        sb.fault(f"host-down:{decode[0]}")
        watch.wait_for(f"{decode[0]} does not answer", timeout=120)
        time.sleep(15)
        assert watch.p.poll() is None, "".join(watch.stderr)[-3000:]
        sb.fault(f"clear:{decode[0]}")   # back as after a reboot: sshd only, no engine runs
        watch.wait_for(f"{decode[0]} answers again", timeout=180)
        _healthy(inv, 600, watch=watch, events=events)
        steps.append(("host down and back", time.monotonic() - t))

        t = time.monotonic()
        sb.fault(f"kv-pressure:{decode[1]}")
        time.sleep(20)
        sb.fault(f"clear:{decode[1]}")
        _healthy(inv, 300, watch=watch, events=events)
        steps.append(("kv-pressure", time.monotonic() - t))
        time.sleep(5)
        assert watch.p.poll() is None, "".join(watch.stderr)[-3000:]
    finally:
        load.stop()
        watch.kill()
        sb.fault("clear:all")
    print("\nchaos steps: " + ", ".join(f"{n} {s:.0f}s" for n, s in steps))
    print(f"clients: {load.ok} ok, errors {load.kinds()}")
    print("".join(watch.stderr)[-3000:])
    assert load.errors == [], load.errors[:10]
    assert load.ok >= 100

    # the downed host's engines serve again, on the release the cluster runs
    st = _healthy(inv, 60, settle=0)
    sup = _supervised(sb)
    back = {k: v for k, v in sup.items() if k.startswith(f"{decode[0]}:")}
    assert back and all(v["state"] == "running" for v in back.values()), back
    assert [(m["router"], m["missing"]) for m in st["proxy"]["membership"]] == [(0, []), (1, [])]
    new = [json.loads(x) for x in events.read_text().splitlines()[seen:]]
    host_events = [(e["host"], e["result"]) for e in new if e.get("event") == "host"]
    assert host_events == [(decode[0], "unreachable"), (decode[0], "back")], new
