"""`observe up` decides per host what to run before any playbook: binaries present, a site's own node_exporter
kept, the monitoring processes tagged with exactly their command and files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml
from fake_sessions import fake_sessions

from kimictl import observe, observe_up
from kimictl.errors import KimictlError
from kimictl.hostops import HostObservation, compute_changes
from kimictl.observe_up import OBSERVE_USER, PROMETHEUS, HostProbe, desired_procs, plan_actions, user_vars
from kimictl.pipeline import prepare
from kimictl.topology import Slo

REPO = Path(__file__).resolve().parents[2]
BINS = {"prometheus": "/usr/bin/prometheus", "prometheus-node-exporter": "/usr/bin/prometheus-node-exporter"}


@pytest.fixture(scope="module")
def pd():
    p = prepare(REPO / "inventories/a3-pd.yml", "a3-pd")
    return p, observe.render_observe(p.plan, p.inventory, p.topology), observe.load_config()


def probes(p, **over) -> dict[str, HostProbe]:
    return {h.name: over.get(h.name, HostProbe(dict(BINS), {}, False)) for h in p.inventory.hosts}


def test_each_host_runs_node_exporter_the_proxy_host_the_exporter_and_prometheus(pd):
    p, r, cfg = pd
    procs, node = desired_procs(p.plan, p.inventory, r, cfg, probes(p))
    by = {(x.host, x.id): x for x in procs}
    proxy = p.plan.proxy
    assert set(by) == {(h.name, "node-exporter") for h in p.inventory.hosts} | {
        (proxy.host, "proxy-exporter"), (r.monitor_host, "prometheus")}
    assert node == {h.name: "kimictl" for h in p.inventory.hosts}
    ip = p.inventory.host(proxy.host).ip
    assert by[(proxy.host, "node-exporter")].cmd == ["/usr/bin/prometheus-node-exporter",
                                                     f"--web.listen-address={ip}:9100"]
    exp = by[(proxy.host, "proxy-exporter")].cmd
    assert exp[:2] == ["python3", "/var/lib/kimi/bin/proxy_exporter.py"] and exp[4:6] == ["--front-port", "8000"]
    assert [exp[i + 1] for i, a in enumerate(exp) if a == "--router"] == [
        f"{rp.port}:{rp.metrics_port}" for rp in proxy.routers]
    prom = by[(r.monitor_host, "prometheus")].cmd
    assert prom[0] == "/usr/bin/prometheus" and "--config.file=/var/lib/kimi/observe/prometheus.yml" in prom
    assert f"--web.listen-address={ip}:9090" in prom and "--storage.tsdb.retention.time=15d" in prom
    assert not any("lifecycle" in a for a in prom), "no unauthenticated /-/quit on the business network"
    # a changed rule restarts Prometheus (new tag); the other processes keep theirs
    topo = p.topology.model_copy(update={"slo": Slo(tpot_ms=40)})
    r2 = observe.render_observe(p.plan, p.inventory, topo)
    by2 = {(x.host, x.id): x for x in desired_procs(p.plan, p.inventory, r2, cfg, probes(p))[0]}
    assert by2[(r.monitor_host, "prometheus")].tag != by[(r.monitor_host, "prometheus")].tag
    assert by2[(proxy.host, "node-exporter")].tag == by[(proxy.host, "node-exporter")].tag


def test_a_sites_own_node_exporter_is_kept_and_ours_is_not_doubled(pd):
    p, r, cfg = pd
    other = p.inventory.hosts[1].name
    procs, node = desired_procs(p.plan, p.inventory, r, cfg, probes(p, **{other: HostProbe(dict(BINS), {}, True)}))
    assert node[other] == "existing" and (other, "node-exporter") not in {(x.host, x.id) for x in procs}
    # ours answering on the port is ours, not a site's
    ours = HostProbe(dict(BINS), {"node-exporter": {"state": "running", "tag": "x"}}, True)
    procs, node = desired_procs(p.plan, p.inventory, r, cfg, probes(p, **{other: ours}))
    assert node[other] == "kimictl" and (other, "node-exporter") in {(x.host, x.id) for x in procs}


def test_missing_binaries_fail_before_anything_runs_naming_the_hosts(pd):
    p, r, cfg = pd
    first, second = (h.name for h in p.inventory.hosts)
    bare = {first: HostProbe({"prometheus-node-exporter": "/x"}, {}, False), second: HostProbe({}, {}, False)}
    with pytest.raises(KimictlError) as e:
        desired_procs(p.plan, p.inventory, r, cfg, bare)
    assert e.value.code == 1
    assert e.value.details == [f"{second}: none of prometheus-node-exporter, node_exporter is installed",
                               f"{first}: none of prometheus is installed"]
    assert "apt-get install prometheus prometheus-node-exporter" in e.value.hint and "--print" in e.value.hint


# --- issue 27: the monitoring processes run as their own unprivileged user ----------------------------------------


def test_every_monitoring_process_starts_as_the_observe_user_and_a_root_one_is_replaced(pd):
    p, r, cfg = pd
    pr = probes(p)
    procs, _ = desired_procs(p.plan, p.inventory, r, cfg, pr)
    hosts = [h.name for h in p.inventory.hosts]
    stops, starts, _ = plan_actions(compute_changes(procs, {h: HostObservation({}, None) for h in hosts}), pr)
    assert not stops and sorted((h, a["id"]) for h, acts in starts.items() for a in acts) == sorted(
        (x.host, x.id) for x in procs)
    assert {a["user"] for acts in starts.values() for a in acts} == {OBSERVE_USER} != {"root"}
    assert user_vars(hosts, pr, r.monitor_host, starts) == {"user_of": dict.fromkeys(hosts, OBSERVE_USER),
                                                            "prometheus_user": OBSERVE_USER}
    # what an earlier kimictl started as root has another tag: stopped, handed over, started as the user
    as_root = {x.host: {} for x in procs}
    for x in procs:
        as_root[x.host][x.id] = {"state": "running", "tag": "tag-of-a-root-process", "cmd": x.cmd}
    changes = compute_changes(procs, {h: HostObservation(s, None) for h, s in as_root.items()})
    assert {c.action for c in changes} == {"replace"}
    stops, starts, actions = plan_actions(changes, pr)
    assert {h: sorted(v) for h, v in stops.items()} == {h: sorted(a["id"] for a in v) for h, v in starts.items()}
    assert all(a["start"] and not a["stop"] for a in actions.values())  # the report still says "start"
    # running as the user already: Prometheus is kept, its data directory is not walked again
    kept = {x.host: {} for x in procs}
    for x in procs:
        kept[x.host][x.id] = {"state": "running", "tag": x.tag, "cmd": x.cmd}
    kept[r.monitor_host].pop(PROMETHEUS)
    _, starts, _ = plan_actions(compute_changes(procs, {h: HostObservation(s, None) for h, s in kept.items()}), pr)
    assert user_vars(hosts, pr, r.monitor_host, starts)["prometheus_user"] == OBSERVE_USER
    assert user_vars(hosts, pr, r.monitor_host, {})["prometheus_user"] is None


def test_a_host_kimictl_does_not_log_in_to_as_root_runs_them_as_that_login(pd):
    p, r, cfg = pd
    other = next(h.name for h in p.inventory.hosts if h.name != r.monitor_host)
    pr = probes(p, **{other: HostProbe(dict(BINS), {}, False, root=False)})
    procs, _ = desired_procs(p.plan, p.inventory, r, cfg, pr)
    _, starts, _ = plan_actions(compute_changes(procs, {h: HostObservation({}, None) for h in pr}), pr)
    assert {a["user"] for a in starts[other]} == {None}
    assert user_vars(list(pr), pr, r.monitor_host, starts)["user_of"][other] is None
    # the same command as root or not is another process (its tag says whom it runs as)
    root_tags = {(x.host, x.id): x.tag for x in desired_procs(p.plan, p.inventory, r, cfg, probes(p))[0]}
    assert all((x.tag == root_tags[(x.host, x.id)]) == (x.host != other) for x in procs)


def test_the_probe_says_whether_kimictl_logs_in_as_root(pd, monkeypatch):
    p, _, cfg = pd
    uids = dict(zip((h.name for h in p.inventory.hosts), ("0", "1000"), strict=True))

    def answer(host: str, cmd: str) -> str:
        assert cmd.endswith("echo @@kimi; id -u")
        return "prometheus=/usr/bin/prometheus\n@@kimi\n[]\n@@kimi\n1\n@@kimi\n" + uids[host] + "\n"

    monkeypatch.setattr(observe_up, "Sessions", fake_sessions(answer))
    got = observe_up.probe_hosts(p.inventory, list(uids), cfg)
    assert {h: (g.root, g.user, g.node_port_open, g.binaries) for h, g in got.items()} == {
        h: (uid == "0", observe_up.OBSERVE_USER if uid == "0" else None, False, {"prometheus": "/usr/bin/prometheus"})
        for h, uid in uids.items()}


def test_observe_yml_starts_each_process_with_its_user_and_creates_that_user():
    play = yaml.safe_load((REPO / "playbooks/observe.yml").read_text())[0]
    tasks = {t["name"]: t for t in play["tasks"]}
    start = next(t for n, t in tasks.items() if n.startswith("Start monitoring processes"))
    argv = jinja2.Environment().from_string(start["ansible.builtin.command"]["argv"])
    cmd = ["/usr/bin/prometheus", "--config.file=x"]

    def rendered(user):
        out = argv.render(sd="/sd", od="/sd/observe", kimi={"grace": 10},
                          item={"id": "prometheus", "tag": "t1", "cmd": cmd, "user": user})
        return yaml.safe_load(out)

    as_user = rendered("kimi-observe")
    assert as_user[:3] == ["python3", "/sd/bin/supervisor.py", "start"] and as_user[-3:] == ["--", *cmd]
    assert as_user[as_user.index("--user") + 1] == "kimi-observe" and as_user.index("--user") < as_user.index("--")
    assert "--user" not in rendered(None)
    user = tasks["Create the monitoring user (no login, no home)"]
    made = {next(k for k in t if k.startswith("ansible.builtin.")): t for t in user["block"]}
    assert made["ansible.builtin.user"]["ansible.builtin.user"]["system"] is True
    assert made["ansible.builtin.user"]["ansible.builtin.user"]["shell"] == "/usr/sbin/nologin"
    assert user["when"] == "kimi.user_of[inventory_hostname] is not none"
    check = subprocess.run([str(Path(sys.executable).parent / "ansible-playbook"), "--syntax-check", "-i",
                            "localhost,", str(REPO / "playbooks/observe.yml")], capture_output=True, text=True,
                           check=False)
    assert check.returncode == 0, check.stderr


@pytest.mark.parametrize(("bins", "sup", "why"), [
    ("prometheus=/usr/bin/prom{{ lookup('pipe','id') }}", "[]", "not an absolute path"),
    ("prometheus=relative/prometheus", "[]", "not an absolute path"),
    ("curl=/usr/bin/curl", "[]", "not an absolute path of one of the binaries"),
    ("prometheus=/usr/bin/prometheus", '[{"name": "x{{ 7*7 }}", "state": "running"}]', "not a process id"),
])
def test_the_probe_refuses_what_a_host_makes_up(pd, monkeypatch, bins, sup, why):
    """Binary paths and process records a host reports become commands and playbook vars: checked first (issue 27)."""
    from kimictl.errors import HostError

    p, _, cfg = pd
    host = p.inventory.hosts[0].name
    answer = f"{bins}\n@@kimi\n{sup}\n@@kimi\n1\n@@kimi\n0\n"
    monkeypatch.setattr(observe_up, "Sessions", fake_sessions(lambda h, cmd: answer))
    with pytest.raises(HostError, match=why) as err:
        observe_up.probe_hosts(p.inventory, [host], cfg)
    assert err.value.host == host
