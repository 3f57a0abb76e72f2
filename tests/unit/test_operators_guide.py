"""docs/operators.md and the README without hosts: every shell block is marked, every kimictl command names only
flags its --help lists, the plan excerpts and the topology table match `kimictl plan`, the inventory examples
validate, and every preflight check's fix points at its row of the guide
(tests/sandbox/test_operators_guide_run.py runs the sandbox blocks)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kimictl.cli.main import app
from kimictl.facts import check_specs

_spec = importlib.util.spec_from_file_location("guide_doc", Path(__file__).resolve().parents[1] / "guide_doc.py")
doc = importlib.util.module_from_spec(_spec)
sys.modules["guide_doc"] = doc
_spec.loader.exec_module(doc)

DOCS = [doc.GUIDE, doc.README]
ALL_BLOCKS = [b for path in DOCS for b in doc.blocks(path)]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in doc.SHELL_LANGS]


def _kimictl(*args: str, state_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimictl", *args], capture_output=True, text=True, timeout=120,
                          cwd=doc.ROOT, check=False, env={**os.environ, "KIMICTL_STATE_DIR": str(state_dir)})


def test_every_shell_block_is_marked() -> None:
    bad = [f"{b.where}: ```{b.lang} {' '.join(b.marks)}" for b in SHELL_BLOCKS
           if len(b.marks) != 1 or b.marks[0] not in doc.MARKS.get(b.lang, set())]
    assert not bad, f"mark each shell block ({doc.MARKS}):\n" + "\n".join(bad)
    guide = [b for b in SHELL_BLOCKS if b.path == doc.GUIDE]
    assert len([b for b in guide if "sandbox" in b.marks]) >= 15   # the parser still finds the guide's blocks
    outputs = [b for b in ALL_BLOCKS if b.lang == "text" and "output" in b.marks]
    attached = {id(b.output) for b in ALL_BLOCKS if b.output}
    assert outputs and all(id(o) in attached for o in outputs), "a ```text output block must follow a shell block"
    assert all("sandbox" in b.marks for b in ALL_BLOCKS if b.output), "only sandbox blocks have checked output"


def test_an_exit_code_block_ends_with_the_command_it_is_about() -> None:
    for b in (b for b in SHELL_BLOCKS if b.exit):
        last = [ln for ln in b.text.splitlines() if ln.strip()][-1]
        assert not last.endswith("\\") and doc.kimictl_invocations(last), b.where


@pytest.fixture(scope="module")
def cli_tree():
    """kimictl's command tree (typer's own click: a group has `.commands`)."""
    return typer.main.get_command(app)


def _help(path: list[str], cache: dict = {}) -> str:  # noqa: B006 - a module-level memo on purpose
    key = tuple(path)
    if key not in cache:
        res = CliRunner().invoke(app, [*path, "--help"], terminal_width=200)
        assert res.exit_code == 0, (path, res.output)
        cache[key] = res.output
    return cache[key]


def _check_flags(args: list[str], tree, where: str) -> list[str]:
    """Problems with one `kimictl ARGS`: an unknown subcommand, or a flag its --help does not list."""
    cmd, path = tree, []
    for a in args:
        if a in getattr(cmd, "commands", {}):
            cmd, path = cmd.commands[a], [*path, a]
        else:
            break
    if hasattr(cmd, "commands") and args[len(path):] and not args[len(path)].startswith("-"):
        return [f"{where}: kimictl {' '.join(args)}: no command {args[len(path)]!r} under {' '.join(path)}"]
    text = _help(path)
    return [f"{where}: kimictl {' '.join(args)}: `kimictl {' '.join(path)} --help` does not list {f}"
            for f in doc.flags(args[len(path):]) if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text)]


def test_every_kimictl_command_uses_flags_its_help_lists(cli_tree) -> None:
    problems: list[str] = []
    count = 0
    for b in SHELL_BLOCKS:
        for args in doc.kimictl_invocations(b.text):
            count += 1
            problems += _check_flags(args, cli_tree, b.where)
    for path in DOCS:
        for args in doc.inline_invocations(path):
            count += 1
            problems += _check_flags(args, cli_tree, str(path.relative_to(doc.ROOT)))
    assert count > 60 and not problems, "\n".join(problems)


def test_the_flag_check_catches_a_renamed_flag_and_a_wrong_command(cli_tree) -> None:
    assert _check_flags(["deploy", "-i", "inv.yml", "--topology", "a3-pd", "--yes"], cli_tree, "x") == []
    assert _check_flags(["deploy", "-i", "inv.yml", "--topolgy", "a3-pd"], cli_tree, "x")
    assert _check_flags(["weights", "fetch", "-i", "inv.yml"], cli_tree, "x")
    assert _check_flags(["logs", "-i", "inv.yml", "--host/--rolez"], cli_tree, "x")


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "console" and "offline" in b.marks],
                         ids=lambda b: b.where)
def test_offline_console_output_is_what_kimictl_prints(block, tmp_path: Path) -> None:
    commands = re.split(r"^\$ ", block.text, flags=re.M)[1:]
    assert commands, f"{block.where}: no `$ kimictl ...` line"
    for chunk in commands:
        line, _, expected = chunk.partition("\n")
        argv = shlex.split(line)
        assert argv[0] == "kimictl", block.where
        proc = _kimictl(*argv[1:], state_dir=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        missing = doc.missing_lines(expected, proc.stdout)
        assert not missing, f"{block.where}: not in the output of `{line}`:\n" + "\n".join(missing)


def test_the_output_matcher_is_strict_about_order_and_text() -> None:
    out = "cluster x  state healthy  release abc\nproxy a (1.2.3.4:8000): ready\nSLO met\n"
    assert doc.missing_lines("cluster x  state healthy  release ...\n...\nSLO met\n", out) == []
    assert doc.missing_lines("SLO met\ncluster x  state ...\n", out) == ["cluster x  state ..."]
    assert doc.missing_lines("SLO missed\n", out) == ["SLO missed"]
    assert doc.missing_lines("proxy a (...:8000): ready, more\n", out)


def _plan_row(preset: str, tmp_path: Path) -> list[str]:
    proc = _kimictl("plan", "-i", f"inventories/{preset}.yml", "--topology", preset, "--output", "json",
                    state_dir=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    p = json.loads(proc.stdout)
    shapes: dict[tuple, int] = {}
    for i in p["instances"]:
        shapes[(i["role"], i["dp"], i["tp"])] = shapes.get((i["role"], i["dp"], i["tp"]), 0) + 1
    pre, dec = p["fits"]["prefill"], p["fits"]["decode"]
    decode_ranks = sum(i["dp"] for i in p["instances"] if i["role"] == "decode")
    return [preset, f"{len(p['host_roles'])} x {p['hardware'].removeprefix('atlas-800-').upper()}",
            ", ".join(f"{n} {r} DP{dp} x TP{tp}" for (r, dp, tp), n in shapes.items()),
            f"{pre['weights_total_gib']:.2f} / {dec['weights_total_gib']:.2f}",
            f"{pre['kv_cache_gib']:.2f} / {dec['kv_cache_gib']:.2f}",
            f"{pre['kv_tokens_per_dp_rank']:,} / {dec['kv_tokens_per_dp_rank']:,}",
            str(dec["max_seqs_per_dp_rank"] * decode_ranks)]


def test_the_topology_table_quotes_what_plan_computes(tmp_path: Path) -> None:
    rows = doc.plan_summary_table()
    assert [r[0] for r in rows] == ["a3-pd", "a3-pd-2p1d", "a2-pd"]
    for r in rows:
        assert r == _plan_row(r[0], tmp_path)


@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if b.lang == "yaml" and "inventory" in b.marks],
                         ids=lambda b: b.where)
def test_inventory_examples_validate(block, tmp_path: Path) -> None:
    inv = tmp_path / "inventory.yml"
    inv.write_text(block.text)
    proc = _kimictl("validate", "-i", str(inv), "--topology", block.attrs["topology"], state_dir=tmp_path)
    assert proc.returncode == 0, f"{block.where}: {proc.stderr[-2000:]}"


def test_every_preflight_fix_points_at_its_row_of_the_guide() -> None:
    anchors = doc.anchors()
    for cid, spec in check_specs().items():
        anchor = f"t-{cid.lower()}"
        assert spec.fix.endswith(f"see docs/operators.md#{anchor}"), cid
        assert anchor in anchors and cid in doc.row(anchor), cid


def test_every_link_inside_the_guide_lands() -> None:
    text = doc.GUIDE.read_text()
    heads = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    targets = set(re.findall(r"\]\(#([^)]+)\)", text))
    assert not targets - heads - doc.anchors(), sorted(targets - heads - doc.anchors())
    for rel in set(re.findall(r"\]\(((?:\.\./)?[\w./-]+\.md)(?:#[^)]*)?\)", text)):
        assert (doc.GUIDE.parent / rel).exists(), rel


def test_every_row_kimictl_points_at_exists() -> None:
    """A hint or fix in kimictl's code or data that names a row of the guide (`guide("t-...")`,
    `docs/operators.md#t-...`) names one that is there."""
    named = {}
    for path in (doc.ROOT / "kimictl").rglob("*"):
        if path.suffix in (".py", ".yml") and "sandbox" not in path.parts:
            for m in re.finditer(r"guide\(\s*['\"](t-[\w-]+)['\"]|operators\.md#(t-[\w-]+)", path.read_text()):
                named.setdefault(m.group(1) or m.group(2), path.name)
    assert {"t-engine-start", "t-proxy-start", "t-readiness", "t-net-004"} <= set(named)
    assert not set(named) - doc.anchors(), {a: f for a, f in named.items() if a not in doc.anchors()}


def test_the_readme_links_the_guide_first() -> None:
    first = re.search(r"\]\(([^)]+)\)", doc.README.read_text())
    assert first and first.group(1) == "docs/operators.md"


def test_deploy_smoke_failures_point_at_their_rows(tmp_path: Path, monkeypatch) -> None:
    from test_orchestration import FakeHttp, _deploy, _deploy_setup

    from kimictl import health
    from kimictl.errors import HostError

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    inv, _, new, ops = _deploy_setup(tmp_path)
    with pytest.raises(HostError, match="smoke completion through") as failed:
        _deploy(inv, new, ops, FakeHttp(broken=lambda url: url.endswith("/v1/completions"))).run()
    assert failed.value.step == "smoke" and failed.value.hint == "docs/operators.md#t-smoke"

    class EmptyAnswer(FakeHttp):
        """vllm-ascend's proxy when the decode leg fails: 200 already sent, then nothing."""

        def http_post_json(self, url: str, body: dict, timeout: float = 60.0, api_key: str | None = None):
            return (200, "") if url.endswith("/v1/completions") else super().http_post_json(url, body, timeout)

    with pytest.raises(HostError, match=r"failed: HTTP 200: \(an empty answer\)") as empty:
        _deploy(inv, new, ops, EmptyAnswer()).run()
    assert empty.value.hint == "docs/operators.md#t-smoke" and "HTTP 200: (an empty answer)" in doc.row("t-smoke")

    class DecodeOnly(FakeHttp):
        """Requests complete, but decode's external-KV counter never moves: a silent decode-only fallback."""

        def metric_totals(self, ip: str, port: int, timeout: float = 3.0) -> dict[str, float]:
            return {**super().metric_totals(ip, port, timeout), health.DECODE_COUNTER: 0.0}

    with pytest.raises(HostError, match="did not go prefill -> decode") as silent:
        _deploy(inv, new, ops, DecodeOnly()).run()
    assert silent.value.hint == "docs/operators.md#t-no-kv"
    assert "did not go prefill -> decode" in doc.row("t-no-kv") and "`smoke`" in doc.row("t-smoke")


@pytest.mark.parametrize(("code", "decode_moves", "anchor"), [(500, False, "t-pair-probe"), (200, False, "t-no-kv"),
                                                              (200, True, None), ("empty", False, "t-pair-probe")])
def test_a_failed_pair_probe_points_at_its_row(monkeypatch, code, decode_moves: bool, anchor) -> None:
    """("empty": vllm-ascend's proxy answers 200 with an empty body when the decode leg fails)"""
    from kimictl import status

    ticks = iter(range(1, 100))
    monkeypatch.setattr(status.health, "metric_totals", lambda ip, port, *a, **k: {
        status.health.PREFILL_COUNTER: float(next(ticks)),
        status.health.DECODE_COUNTER: float(next(ticks)) if decode_moves else 0.0})
    monkeypatch.setattr(status.health, "http_post_json", lambda url, body, **k: (
        (200, "") if code == "empty" else (code, {"choices": [{"text": "x"}]} if code == 200 else "KV transfer")))
    engines = [status.EngineStatus(id=f"{r}-0-dp0", host="h", role=r, state="ready", ip="10.0.0.1", port=7100)
               for r in ("prefill", "decode")]
    proxy = status.ProxyStatus(host="h", ip="10.0.0.1", port=8000, routers=1, router="vllm-router", state="ready")
    pair = status._pair_probe(engines, proxy, "kimi-k2.5")
    assert pair.state == ("ok" if anchor is None else "failed")
    assert pair.hint == (anchor and f"docs/operators.md#{anchor}")
    if code == "empty":
        assert pair.detail.startswith("HTTP 200 without a completion; ") and "(an empty answer)" in pair.detail
        assert "HTTP 200 without a completion" in doc.row("t-pair-probe")
    if anchor:
        assert anchor in doc.anchors()


def test_every_known_log_line_is_quoted_in_its_row() -> None:
    """`kimictl logs` names a row for each line of data/log_lines.yml: the row exists, quotes the example, and the
    pattern matches the example."""
    from kimictl.facts import log_lines

    known = log_lines()
    assert {k.anchor for k in known} >= {"t-kv-recompute", "t-kv-port", "t-hccl-timeout", "t-kv-transfer", "t-hbm-oom"}
    for k in known:
        assert k.anchor in doc.anchors(), k.anchor
        assert re.search(k.pattern, k.example) and k.example in doc.row(k.anchor), k.anchor


def test_logs_name_the_rows_of_the_lines_they_hold() -> None:
    from kimictl.logs import log_hints

    logs = [{"host": "atlas-02", "id": f"decode-0-dp{r}", "lines": [
        "INFO 07-01 10:00:00 [loggers.py:123] Engine 000: Avg prompt throughput: 0.0 tokens/s",
        *[f"WARNING 07-01 10:00:0{i} [recompute_scheduler.py:872] [RecomputeScheduler] Recompute triggered for "
          f"request cmpl-{r}{i}." for i in range(r + 1)]]} for r in range(2)]
    logs.append({"host": "atlas-01", "id": "prefill-0-dp0", "lines": [
        "zmq.error.ZMQError: Address already in use (addr='tcp://10.0.0.11:36000')"]})
    logs.append({"host": "atlas-01", "id": "proxy", "lines": ["INFO:     Uvicorn running on http://127.0.0.1:8001"]})
    hints = {h["hint"]: h for h in log_hints(logs)}
    assert sorted(hints) == ["docs/operators.md#t-kv-port", "docs/operators.md#t-kv-recompute"]
    rc = hints["docs/operators.md#t-kv-recompute"]
    assert rc["engines"] == ["decode-0-dp0", "decode-0-dp1"] and rc["count"] == 3
    assert rc["line"].endswith("Recompute triggered for request cmpl-11.") and "KV cache" in rc["what"]
    assert hints["docs/operators.md#t-kv-port"]["engines"] == ["prefill-0-dp0"]


def test_the_simulated_engines_kv_transfer_error_is_a_known_line() -> None:
    """The sandbox's decode logs its failed pull (engine_sim.pull_kv); the pair-probe row sends the operator there."""
    from kimictl.logs import log_hints

    line = ("ERROR 12-03 10:00:00 [engine_sim] KV transfer for request cmpl-7 from prefill engine prefill-0-dp0 at "
            "10.0.0.11:7200 failed: GET http://10.0.0.11:7200/kv/cmpl-7 -> HTTP 503: transfer engine: device link down")
    hints = log_hints([{"host": "atlas-02", "id": "decode-0-dp2", "lines": [line]}])
    assert [(h["engines"], h["hint"]) for h in hints] == [(["decode-0-dp2"], "docs/operators.md#t-kv-transfer")]
