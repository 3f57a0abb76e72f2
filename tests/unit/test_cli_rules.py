"""Rules every command follows: shared options are one definition, one confirm-or---yes rule for commands that
change what serves, shell completion, and no Python repr in human output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from kimictl.cli.main import app

ROOT = Path(__file__).resolve().parents[2]


def _commands() -> dict:
    """Every leaf command by its full name (`weights pull`), as click sees it."""
    out: dict = {}

    def walk(group, prefix: str) -> None:
        for name, cmd in group.commands.items():
            if hasattr(cmd, "commands"):
                walk(cmd, f"{prefix}{name} ")
            else:
                out[f"{prefix}{name}"] = cmd

    walk(typer.main.get_command(app), "")
    return out


@pytest.mark.parametrize("flag", ["--accept-new-host-keys", "--limit", "--yes", "--ready-timeout", "--token-file",
                                  "--skip-preflight"])
def test_a_shared_option_is_spelled_and_explained_the_same_everywhere(flag: str) -> None:
    seen = {name: p for name, cmd in _commands().items() for p in cmd.params if flag in getattr(p, "opts", [])}
    assert len(seen) >= 2, f"{flag} is not shared"
    shapes = {(tuple(p.opts), p.help, p.multiple, getattr(p, "metavar", None)) for p in seen.values()}
    assert len(shapes) == 1, f"{flag} differs between {sorted(seen)}: {shapes}"


def test_every_command_that_changes_what_serves_takes_yes() -> None:
    cmds = _commands()
    for name in ("deploy", "rollout", "rollback", "stop", "start"):
        assert any("--yes" in getattr(p, "opts", []) for p in cmds[name].params), name


@pytest.fixture
def inventory(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    doc = {"all": {"vars": {"kimi_cluster": "cli-rules", "kimi_model_dir": "/data/models/Kimi-K2.5-W4A8",
                            "kimi_runtime": "host", "kimi_nic": "eth0", "kimi_model_source": "local",
                            "kimi_proxy_script": "/opt/vllm-ascend/examples/proxy.py"},
                   "hosts": {"atlas-01": {"ansible_host": "10.9.0.11", "kimi_hardware": "atlas-800-a3"},
                             "atlas-02": {"ansible_host": "10.9.0.12", "kimi_hardware": "atlas-800-a3"}}}}
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc))
    return tmp_path / "inv.yml"


@pytest.mark.parametrize("args", [["deploy", "--topology", "a3-pd"], ["stop"], ["start"], ["stop", "--limit",
                                                                                             "atlas-02"]])
def test_without_a_terminal_a_change_needs_yes_and_nothing_is_touched(inventory: Path, args: list[str],
                                                                     monkeypatch) -> None:
    from kimictl import deploy, hostops, lifecycle

    def contacted(*a, **k):
        pytest.fail("hosts were contacted")

    for mod, name in ((hostops, "observe"), (lifecycle, "observe"), (lifecycle, "read_current"),
                      (deploy.Deployer, "run")):
        monkeypatch.setattr(mod, name, contacted)
    for output in ([], ["--output", "json"]):
        r = CliRunner().invoke(app, [args[0], "-i", str(inventory), *args[1:], *output])  # stdin is not a TTY
        assert r.exit_code == 2, r.output
        assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
        text = json.loads(r.stdout)["error"]["message"] if output else r.stderr
        assert "needs --yes" in text and "nothing was changed" in text and "Traceback" not in r.output


def test_completion_is_installed_by_the_cli_and_completes_commands() -> None:
    r = CliRunner().invoke(app, ["--help"])
    assert "--install-completion" in r.stdout
    env = {"_KIMICTL_COMPLETE": "complete_bash", "COMP_WORDS": "kimictl rollo", "COMP_CWORD": "1"}
    r = CliRunner().invoke(app, [], env=env, prog_name="kimictl")   # what bash runs on <TAB>
    assert r.stdout.split() == ["rollout"], r.output


def test_smoke_and_http_bodies_read_as_words_and_json_never_python() -> None:
    from kimictl.deploy import smoke_text
    from kimictl.health import body_text

    text = smoke_text({"url": "http://10.0.0.1:8000/v1/completions", "text": " The KV", "prefill_prompt_tokens": 412.0,
                       "decode_external_prefix_cache_queries": 412.0})
    assert text == ("http://10.0.0.1:8000/v1/completions answered ' The KV' (prefill prompt tokens +412, decode "
                    "external prefix cache queries +412)")
    assert body_text({"error": {"message": "bad", "ok": False}}) == '{"error":{"message":"bad","ok":false}}'
    assert body_text("plain", 3) == "pla"
