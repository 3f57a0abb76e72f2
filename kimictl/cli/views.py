"""Text views (rich tables) of plans and renders; only called for --output text."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from kimictl.plan import Plan
    from kimictl.preflight import PreflightReport
    from kimictl.render import Rendered
    from kimictl.status import LeaseStatus, Quantiles, StatusReport
    from kimictl.topology import Topology


def _ranges(nums: list[int]) -> str:
    if not nums:
        return "-"
    return f"{nums[0]}-{nums[-1]}" if len(nums) > 1 else str(nums[0])


def plan_view(plan: Plan) -> Group:
    head = Text.assemble(
        ("cluster ", "dim"), (plan.cluster, "bold"), ("  topology ", "dim"), (plan.topology, "bold"),
        ("  vllm-ascend ", "dim"), plan.vllm_ascend_version, ("  hardware ", "dim"), plan.hardware,
        ("  runtime ", "dim"), plan.runtime, ("\nimage ", "dim"), plan.image, ("  model ", "dim"), plan.model_dir,
    )
    inst = Table(title="Instances (DP groups)", title_justify="left")
    for col in ("instance", "hosts", "DP x TP", "EP", "DP master", "rpc port", "kv_port range", "engine_id"):
        inst.add_column(col)
    for i in plan.instances:
        kv = f"{i.kv_port}-{i.kv_port + i.dp * i.tp - 1}" if i.kv_port else "-"
        hosts = ", ".join(i.hosts) if len(i.hosts) == 1 else ", ".join(
            f"{h} (ranks {_ranges(sorted(r for e in plan.engines_on(h) if e.instance == i.name for r in e.dp_ranks))})"
            for h in i.hosts)
        inst.add_row(i.name, hosts, f"{i.dp} x {i.tp}", str(i.ep), f"{i.master_host} ({i.master_ip})",
                     str(i.rpc_port), kv, i.engine_id or "-")

    eng = Table(title="Engines (one process each)", title_justify="left")
    for col in ("engine", "host", "role", "DP rank(s)", "NPUs", "HTTP port"):
        eng.add_column(col)
    for e in plan.engines:
        port = str(e.port) if e.serves_http else f"{e.port} (headless)"
        eng.add_row(e.id, e.host, e.role, ",".join(map(str, e.dp_ranks)), _ranges(e.devices), port)

    mem = Table(title="Per-NPU HBM (estimate)", title_justify="left")
    for col in ("role", "usable GiB", "weights GiB", "reserve+act GiB", "KV GiB", "KV tokens / DP rank",
                "seqs @ max-model-len"):
        mem.add_column(col, justify="right" if col != "role" else "left")
    for role, f in plan.fits.items():
        mem.add_row(role, f"{f.usable_gib:.1f} ({f.hbm_gib:.0f} x {f.gpu_memory_utilization:.2f})",
                    f"{f.weights_total_gib:.2f} (experts {f.weights_gib['routed_experts']:.2f})",
                    f"{f.reserve_gib + f.activation_gib + f.draft_gib:.2f}", f"{f.kv_cache_gib:.2f}",
                    f"{f.kv_tokens_per_dp_rank:,}", f"{f.max_seqs_per_dp_rank} x {f.max_model_len}")

    sw = Table(title="Fused kernels and switches", title_justify="left", show_lines=False)
    for col in ("role", "switch", "state", "rendered as", "why"):
        sw.add_column(col, overflow="fold")
    for s in plan.switches:
        style = {"on": "green", "off": "yellow", "skipped": "dim"}[s.state]
        sw.add_row(s.role, s.switch, Text(s.state, style=style), s.spelled or s.note, s.why)

    parts: list = [head, inst, eng, mem, sw]
    if plan.proxy:
        p = plan.proxy
        parts.append(Text.assemble(("P/D proxy ", "bold"), f"{p.host} ({p.ip}:{p.port}), {len(p.routers)} {p.router} "
                                   f"cop{'y' if len(p.routers) == 1 else 'ies'} behind it"
                                   + (f", policy {p.policy}" if p.policy else "")
                                   + f"{', API key' if p.api_key else ''}: {len(p.prefill)} prefill and "
                                   f"{len(p.decode)} decode endpoints"))
        if p.router_why:
            parts.append(Text(f"router: {p.router_why}"))
    for w in plan.warnings:
        parts.append(Text(f"warning: {w}", style="yellow"))
    return Group(*parts)


def render_view(rendered: Rendered, out_dir: str | None) -> Group:
    t = Table(title=f"Rendered engines for {rendered.plan.cluster} ({rendered.plan.topology})", title_justify="left")
    for col in ("engine", "host", "port", "NPUs", "argv"):
        t.add_column(col, overflow="fold")
    for e in rendered.engines:
        t.add_row(e.id, e.host, str(e.port), _ranges(e.devices), " ".join(e.argv[:2]) + f" … ({len(e.argv)} items)")
    rel = Table(title="Releases (hash of each host's files)", title_justify="left")
    rel.add_column("host")
    rel.add_column("release")
    rel.add_column("files", justify="right")
    for host, rid in rendered.releases.items():
        rel.add_row(host, rid, str(len(rendered.files[host])))
    tail = Text(f"wrote {out_dir}/<host>/ and {out_dir}/render.json" if out_dir else
                "nothing written: use --out DIR for the files, --output json for the document", style="dim")
    return Group(t, rel, tail)


def topologies_view(topos: list[Topology]) -> Table:
    t = Table(title="Topology presets", title_justify="left")
    for col in ("name", "hardware", "mode", "roles", "description"):
        t.add_column(col, overflow="fold")
    for topo in topos:
        roles = ", ".join(f"{r} DP{s.dp}xTP{s.tp}/{s.nodes} host(s)" for r, s in topo.roles.items())
        t.add_row(topo.name, topo.hardware or "any", topo.mode, roles, topo.description)
    return t


def print_to_stdout(renderable) -> None:
    import sys

    # Piped output (CI logs) gets a wide fixed width instead of rich's 80 columns. crop=False: a line that must stay
    # one line (no_wrap, e.g. one per unreachable host) runs past the width instead of being cut.
    Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160).print(renderable, crop=False)


def preflight_view(report: PreflightReport) -> Group:
    t = Table(title=f"Preflight for {report.cluster} ({report.topology})", title_justify="left")
    for col in ("host", "check", "result", "message", "fix"):
        t.add_column(col, overflow="fold")
    style = {"pass": "green", "skip": "dim"}
    last = None
    for r in report.results:
        status = r.status if r.status != "fail" else ("FAIL" if r.severity == "error" else r.severity)
        st = style.get(r.status, "bold red" if r.severity == "error" else "yellow")
        t.add_row(r.host if r.host != last else "", f"{r.id} {r.title}", Text(status, style=st), r.message, r.fix)
        last = r.host
    s = report.summary()
    tail = Text(f"{s['hosts']} host(s), {s['checks']} checks: {s['passed']} passed, {s['errors']} error(s), "
                f"{s['warnings']} warning(s), {s['skipped']} skipped in {s['seconds']:.1f}s",
                style="bold green" if report.ok else "bold red")
    return Group(t, tail)


def status_view(report: StatusReport) -> Group:
    color = {"healthy": "bold green", "degraded": "bold yellow", "down": "bold red"}[report.state]
    head = Text.assemble(("cluster ", "dim"), (report.cluster, "bold"), ("  state ", "dim"), (report.state, color),
                         ("  release ", "dim"), str(report.release))
    t = Table(title="Engines", title_justify="left")
    for col in ("engine", "host", "role", "state", "restarts", "running", "waiting", "KV use", "HBM max/NPU",
                "TTFT p50/p99", "ITL p50/p99"):
        t.add_column(col)

    def pct(q: Quantiles | None) -> str:
        if not q or q.p50 is None or q.p99 is None:
            return ""
        return f"{1000 * q.p50:.0f}/{1000 * q.p99:.0f} ms"

    st_style = {"ready": "green", "starting": "yellow", "failed": "bold red", "stopped": "red",
                "unreachable": "bold red"}
    for e in report.engines:
        m = e.metrics
        t.add_row(e.id, e.host, e.role, Text(e.state, style=st_style.get(e.state, "")),
                  "" if e.restarts is None else str(e.restarts), f"{m.requests_running:.0f}" if m else "",
                  f"{m.requests_waiting:.0f}" if m else "", f"{100 * m.kv_cache_usage:.1f}%" if m else "",
                  f"{e.hbm_used_mb.max_per_npu / 1024:.1f} GiB" if e.hbm_used_mb else "",
                  pct(m and m.ttft_s), pct(m and m.itl_s))
    parts: list = [head, t]
    parts += [Text(f"{e.host}: unreachable: {e.detail or ''}", style="bold red", no_wrap=True,
                   overflow="ignore") for e in report.engines if e.state == "unreachable"]
    if p := report.proxy:
        membership = p.membership or []
        members = [m.members for m in membership if m.members is not None]
        parts.append(Text(f"proxy {p.host} ({p.ip}:{p.port}): {p.state}"
                          + (f", router copies list {'/'.join(map(str, members))} endpoint(s)" if members else ""),
                          style="green" if p.state == "ready" else "bold red"))
        for m in membership:
            if m.error is not None:
                parts.append(Text(f"router {m.router} behind the proxy: {m.error}", style="bold red"))
            elif m.missing or m.unknown:
                parts.append(Text(f"router {m.router} behind the proxy lacks {', '.join(m.missing or []) or '-'}"
                                  + (f", lists unknown {', '.join(m.unknown)}" if m.unknown else ""),
                                  style="yellow"))
    for pair in report.pairs:
        parts.append(Text(f"P/D pair probe: {pair.state} - {pair.detail}",
                          style="green" if pair.state == "ok" else "bold red"))
        if pair.hint:
            parts.append(Text(f"hint: {pair.hint}"))
    for d in report.drift:
        parts.append(Text(f"drift: {d.host} runs {d.current}, recorded {d.recorded}", style="yellow"))
    if mon := report.monitoring:
        firing = mon.alerts_firing
        parts.append(Text(f"monitoring: Prometheus {mon.prometheus_url} on {mon.monitor_host}: {mon.state}"
                          + (f", firing {', '.join(firing)}" if firing else ", no alert firing" if
                             mon.state == "ready" else ""),
                          style="green" if mon.state == "ready" and not firing else "yellow"))
    if lease := report.lease:
        parts.append(Text(f"lease: {lease_text(lease)} (lock host {lease.host})", no_wrap=True, overflow="ignore",
                          style={"free": "green", "held": "yellow"}.get(lease.state, "bold red")))
    return Group(*parts)


def lease_text(lease: LeaseStatus) -> str:
    from kimictl.lease import Holder

    if lease.state == "held":
        return f"held by {Holder.of(lease.holder and lease.holder.model_dump()).text()}"
    return lease.state if lease.state != "unknown" else f"unknown: {lease.detail or ''}"

