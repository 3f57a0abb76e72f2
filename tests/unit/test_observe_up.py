"""`observe up` decides per host what to run before any playbook: binaries present, a site's own node_exporter
kept, the monitoring processes tagged with exactly their command and files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimictl import observe
from kimictl.errors import KimictlError
from kimictl.observe_up import HostProbe, desired_procs
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
