"""`kimictl status`: engines, P/D pairs, proxy and drift; exit 0 healthy, 3 degraded, 1 down."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from kimictl.cli.common import InventoryOpt, Output, OutputOpt, emit_json, finite_positive, handle_errors
from kimictl.errors import EXIT_DEGRADED, EXIT_FAILED, EXIT_OK, KimictlError

EXIT_BY_STATE = {"healthy": EXIT_OK, "degraded": EXIT_DEGRADED, "down": EXIT_FAILED}


@handle_errors
def status(
    inventory: InventoryOpt,
    output: OutputOpt = Output.text,
    watch: Annotated[float | None, typer.Option("--watch", min=0.5,
                                                help="Refresh every N seconds until Ctrl-C.")] = None,
    no_pair_probe: Annotated[bool, typer.Option("--no-pair-probe",
                                                help="Skip the probe request through the proxy.")] = False,
    heal: Annotated[bool, typer.Option(
        "--heal", help="When the cluster is not healthy, run a `kimictl heal` round (its report goes under `heal`); "
                       "an escalation exits 1.")] = False,
) -> None:
    """Show every engine's state, the P/D pair probe, the proxy and release drift."""
    from kimictl.cli.common import cluster_inventory
    from kimictl.cluster_record import sync
    from kimictl.status import collect_status

    inv = cluster_inventory(inventory)
    while True:
        try:
            record = sync(inv)   # the cluster's release record: `release` and drift are judged against it
            report = collect_status(inv, probe_pairs=not no_pair_probe)
            if record.problems():
                report.record_drift = record.problems()
            if heal and report.state != "healthy":
                report.heal = _heal_round(inventory)
        except KimictlError as exc:  # a watch outlives what one round cannot do (a host, the record); one look exits
            if not watch:
                raise
            typer.echo(f"error: {exc.render()} (watching on)", err=True)
            time.sleep(watch)
            continue
        if output == Output.json:
            emit_json(report.to_json())
        else:
            from kimictl.cli.views import print_to_stdout, status_view

            print_to_stdout(status_view(report))
            if (h := report.heal) is not None:
                typer.echo(_heal_line(h))
        if report.heal and report.heal.get("result") == "escalated":
            raise typer.Exit(EXIT_FAILED)
        if not watch:
            break
        time.sleep(watch)
    raise typer.Exit(EXIT_BY_STATE[report.state])


def _heal_line(h: dict) -> str:
    """The heal round in one line: its result, the hosts that do not answer, each action."""
    return (f"heal: {h['result']}" + "".join(f" ({host} does not answer)" for host in h.get("unreachable") or {})
            + "".join(f"; {a['slice']} {'/'.join(a['reasons'])} -> {a['result']}" for a in h["actions"]))


def _heal_round(inventory: str) -> dict:
    """One `kimictl heal` round with the defaults (progress and escalations on stderr)."""
    from pathlib import Path

    from kimictl.cli import common
    from kimictl.cli.heal import heal_round, report_failure

    say, on_event = common.reporters("heal", events=("failed", "unreachable"))
    res = heal_round(Path(inventory), {}, say, on_event)
    if res.result in ("failed", "escalated"):
        report_failure(res)
    return res.to_json()


@handle_errors
def bench(
    inventory: InventoryOpt,
    requests: Annotated[int, typer.Option("--requests", min=1, max=100000)] = 64,
    concurrency: Annotated[int, typer.Option("--concurrency", min=1, max=1024)] = 8,
    input_tokens: Annotated[int, typer.Option("--input-tokens", min=1)] = 512,
    output_tokens: Annotated[int, typer.Option("--output-tokens", min=2)] = 64,
    timeout: Annotated[float, typer.Option("--timeout", min=1.0, help="Bound on the whole run, seconds.")] = 300.0,
    slo_tpot_ms: Annotated[float, typer.Option("--slo-tpot-ms", callback=finite_positive,
                                               help="TPOT SLO (p90).")] = 50.0,
    slo_ttft_ms: Annotated[float | None, typer.Option("--slo-ttft-ms", callback=finite_positive,
                                                      help="Optional TTFT SLO (p90).")] = None,
    gate: Annotated[bool, typer.Option("--gate", help="Exit 1 when the SLO is missed or a request fails.")] = False,
    output: OutputOpt = Output.text,
) -> None:
    """Load the serving endpoint (the P/D proxy, or the engine) and report TTFT/TPOT percentiles against the SLO."""
    from kimictl.bench import BenchSpec, check_fits, run_bench
    from kimictl.cli.common import cluster_inventory
    from kimictl.cluster_secrets import proxy_api_key
    from kimictl.deployed import cached_deployment
    from kimictl.errors import KimictlError
    from kimictl.status import collect_status

    inv = cluster_inventory(inventory)
    spec = BenchSpec(requests, concurrency, input_tokens, output_tokens, timeout, slo_tpot_ms, slo_ttft_ms)
    deployed = cached_deployment(inv.cluster.name)
    check_fits(spec, deployed.rendered if deployed else None)   # before any endpoint is asked or loaded
    st = collect_status(inv, probe_pairs=False)
    api_key = None
    if st.proxy and st.proxy.state == "ready":
        host, port = st.proxy.ip, st.proxy.port
        api_key = proxy_api_key(inv)
    else:
        ready = [e for e in st.engines if e.state == "ready" and e.serves_http and e.role == "colocated"]
        if not ready:
            raise KimictlError(f"no serving endpoint is ready (cluster state {st.state}); see `kimictl status`")
        host, port = ready[0].ip, ready[0].port
    doc = run_bench(host, port, st.served_model_name or "", spec, api_key).summary()
    if output == Output.json:
        emit_json(doc)
    else:
        t, p = doc["ttft_ms"], doc["tpot_ms"]

        def f(d: dict) -> str:
            return "n/a" if d["p50"] is None else f"p50 {d['p50']:.1f} / p90 {d['p90']:.1f} / p99 {d['p99']:.1f} ms"

        typer.echo(f"{doc['succeeded']}/{doc['requests']} requests in {doc['wall_s']} s at concurrency "
                   f"{doc['concurrency']} ({doc['input_tokens']} in / {doc['output_tokens']} out) -> {doc['url']}")
        typer.echo(f"TTFT {f(t)}")
        typer.echo(f"TPOT {f(p)}")
        typer.echo(f"throughput {doc['output_tokens_per_s']} output tokens/s, {doc['requests_per_s']} requests/s")
        typer.echo("SLO met" if doc["slo"]["met"] else "SLO missed: " + "; ".join(doc["slo"]["misses"]))
    if gate and not doc["slo"]["met"]:
        raise typer.Exit(EXIT_FAILED)
