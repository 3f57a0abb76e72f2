"""`kimictl heal --once` on the 4-host A3 sandbox (a3-pd = 2P2D behind kimictl's proxy front, the deployment of
test_rollout_slices): a decode engine that hangs while running (`engine-hang-now`: /health answers, completions
stall) is found, drained, restarted, pair-smoked and re-added; `status` is healthy afterwards.

Two client loops run through the proxy. One runs from before the hang to the end: the requests it had in flight on
the hung engine are lost (they stall there, and the restart cuts them; no healer can answer them), at most one per
client thread, and nothing else may fail. The other starts when heal has drained the hung slice and runs through
the restart, the pair smoke, the re-add and the proxy gate: it must see 0 failed requests.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.sandbox.test_rollout_slices import API_KEY, Load, _state_dir, _status, _supervised, cluster, kimictl

pytestmark = pytest.mark.sandbox
__all__ = ["cluster"]  # the deployment this module shares with test_rollout_slices (module-scoped fixture)


def test_heal_once_cures_a_hung_decode_engine_without_client_errors(cluster) -> None:
    sb = cluster
    inv = str(sb.inventory)
    code, st = _status(sb)
    assert code == 0 and st["state"] == "healthy", st
    clean = kimictl("heal", "-i", inv, "--dry-run", "--output", "json", timeout=300)
    assert clean.returncode == 0 and json.loads(clean.stdout)["result"] == "healthy", clean.stderr[-2000:]

    victim = next(e for e in sb.engines if e["role"] == "decode" and e["instance"] == "decode-0")
    host, slice_name = victim["host"], victim["instance"]
    slice_engines = sorted(e["id"] for e in sb.engines if e["instance"] == slice_name)
    before = _supervised(sb)
    proxy = f"http://{sb.host('atlas-01')['ip']}:8000/v1/completions"
    throughout = Load(proxy, threads=2, api_key=API_KEY).start()
    during: Load | None = None
    time.sleep(2)
    sb.fault(f"engine-hang-now:{host}:decode")
    try:
        dry = kimictl("heal", "-i", inv, "--dry-run", "--hang-deadline", "3", "--output", "json", timeout=300)
        assert dry.returncode == 3, dry.stderr[-3000:]
        plan = json.loads(dry.stdout)
        assert [(a["slice"], a["reasons"], a["steps"]) for a in plan["actions"]] == [
            (slice_name, ["hung"], ["drain", "restart", "pair-smoke", "readd"])]
        assert {f["engine"] for f in plan["findings"]} == {e["id"] for e in sb.engines if e["instance"] == slice_name
                                                           and e["serves_http"]}

        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "kimictl", "heal", "-i", inv, "--once", "--hang-deadline", "3",
                                 "--output", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err_lines: list[str] = []
        drained = threading.Event()

        def read_stderr() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                err_lines.append(line)
                if line.startswith("heal drained "):
                    drained.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        assert drained.wait(120), "".join(err_lines)[-3000:]
        during = Load(proxy, threads=2, api_key=API_KEY).start()
        out, _ = proc.communicate(timeout=900)
        reader.join(timeout=10)
        t1 = time.time()
        time.sleep(3)
    finally:
        for load in (throughout, during):
            if load is not None:
                load.stop()
        sb.fault("clear:all")
    stderr = "".join(err_lines)
    assert proc.returncode == 0, stderr[-4000:]
    doc = json.loads(out)
    print(f"\nheal --once took {t1 - t0:.1f}s; actions: {[(a['slice'], a['seconds']) for a in doc['actions']]}")
    print(f"client load from before the hang: {throughout.ok} ok, errors {throughout.kinds()}; from the drain on: "
          f"{during.ok} ok, errors {during.kinds()}")
    print(stderr[-1500:])

    assert doc["result"] == "healed" and doc["release"] == st["release"]
    [action] = doc["actions"]
    assert (action["slice"], action["result"]) == (slice_name, "healed")
    assert action["probes"] and all(p["ok"] for p in action["probes"])
    assert doc["proxy_gate"]["ok"]
    # clients: nothing failed from the drain on; before it, only requests stuck on the hung engine (one per thread)
    assert during.errors == [], during.errors[:5]
    assert during.ok >= 10
    assert len(throughout.errors) <= throughout.threads, throughout.errors[:5]
    assert throughout.last is not None and throughout.last > t1 - 5
    # exactly the hung slice restarted (on the release it ran), nothing else
    after = _supervised(sb)
    restarted = sorted(k.split(":", 1)[1] for k in before if after[k]["child_pid"] != before[k]["child_pid"])
    assert restarted == slice_engines
    assert all(after[k]["tag"] == before[k]["tag"] for k in before)
    code, st2 = _status(sb)
    assert code == 0 and st2["state"] == "healthy", st2
    assert [(m["router"], m["missing"]) for m in st2["proxy"]["membership"]] == [(0, []), (1, [])]
    events = [json.loads(x) for x in (_state_dir(sb) / "heal-events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["slice"], e["result"]) for e in events] == [("action", slice_name, "started"),
                                                                        ("action", slice_name, "healed")]
    assert events[0]["id"] == events[1]["id"]  # one action: "started" written before it touched anything
    assert Path(doc["run_dir"]).is_dir()
    again = kimictl("heal", "-i", inv, "--once", "--output", "json", timeout=300)
    assert again.returncode == 0 and json.loads(again.stdout)["result"] == "healthy", again.stderr[-2000:]
