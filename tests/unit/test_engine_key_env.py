"""The engines' API key reaches them exactly (issue 27): release.yml's own task writes the env file from a key file
with blanks around the key (a real ansible-playbook run, local connection), and the rendered engine.sh and proxy.sh
read it back as their engines and routers do; keys an env line cannot carry as they are are refused, naming the
file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kimictl.ansible import build_run_spec, run_playbook
from kimictl.cluster_secrets import engine_key_file
from kimictl.errors import InvalidInput
from kimictl.inventory import load_inventory
from kimictl.plan import make_plan
from kimictl.render import ENGINE_KEY_ENV, render
from kimictl.topology import load_topology

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y-with-leading-space"
SCRIPT = "/opt/vllm-ascend/examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py"
STATE_DIR = "/var/lib/kimi"  # inventories/a3-pd.yml's kimi_state_dir: where the rendered scripts look


def _key_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "client-key"
    path.write_text(text)
    path.chmod(0o600)
    return path


def _install_key(tmp_path: Path, key_file: Path) -> Path:
    """Run release.yml's "Install the engines' API key" block on this machine; the env file it wrote."""
    release = yaml.safe_load((ROOT / "playbooks/release.yml").read_text())
    block = next(t for t in release[0]["tasks"] if "VLLM_API_KEY" in yaml.safe_dump(t))
    sd = tmp_path / "sd"
    playbook = tmp_path / "install-key.yml"
    playbook.write_text(yaml.safe_dump([{"hosts": "all", "gather_facts": False, "vars": {"sd": str(sd)},
                                         "tasks": [block]}]))
    inventory = tmp_path / "inv.yml"
    inventory.write_text(f"all:\n  hosts:\n    local1:\n      ansible_connection: local\n"
                         f"      ansible_python_interpreter: {sys.executable}\n")
    res = run_playbook(build_run_spec(tmp_path / "run", str(playbook), inventory,
                                      {"kimi": {"engine_key_file": str(key_file)}}, ident="01-key", hosts=["local1"]))
    assert res.ok, res.failures
    return sd / ENGINE_KEY_ENV


def _run_until_exec(script: str, env_file: Path, workdir: Path, echo: str) -> str:
    """The rendered script with the installed env file in place of the host's, stopped where it would exec."""
    head = script.replace(f"{STATE_DIR}/{ENGINE_KEY_ENV}", str(env_file)).split("\nexec ", 1)[0]
    path = workdir / "until-exec.sh"
    path.write_text(f'{head}\nprintf %s "${echo}"\n')
    proc = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(workdir)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_key_file_with_blanks_around_the_key_gives_engines_and_routers_exactly_the_key(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    key_file = _key_file(tmp_path, f"  \n  {KEY}\n")
    env_file = _install_key(tmp_path, key_file)
    # docker's --env-file takes everything after the first = as the value: the line must be exactly this
    assert env_file.read_text() == f"VLLM_API_KEY={KEY}\n" and env_file.stat().st_mode & 0o777 == 0o600

    doc = yaml.safe_load((ROOT / "inventories/a3-pd.yml").read_text())
    doc["all"]["vars"].update(kimi_api_key_file=str(key_file), kimi_runtime="host", kimi_proxy_script=SCRIPT)
    (tmp_path / "a3-pd.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    inv, topo = load_inventory(tmp_path / "a3-pd.yml"), load_topology("a3-pd")
    assert engine_key_file(inv, pd=False) == key_file  # colocated engines would get the clients' key file as it is
    plan = make_plan(inv, topo)
    r = render(plan, inv, topo)
    assert plan.engine_api_key and KEY not in r.model_dump_json()
    files = r.files["a3-node-02"]
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines/decode-0-dp0.env").write_text(files["engines/decode-0-dp0.env"])
    assert _run_until_exec(files["engines/decode-0-dp0.sh"], env_file, tmp_path / "engines", "VLLM_API_KEY") == KEY
    proxy = r.files["a3-node-01"]["proxy/proxy.sh"]
    assert _run_until_exec(proxy, env_file, tmp_path, "OPENAI_API_KEY") == KEY


@pytest.mark.parametrize("text", ["~/k3y", "~", "k3y $HOME", "k3y\\x", "'k3y'", "k3y\nsecond"])
def test_a_key_an_env_line_cannot_carry_is_refused_naming_the_file(tmp_path: Path, monkeypatch, text: str) -> None:
    from kimictl.secret_file import check_env_key

    key_file = _key_file(tmp_path, text + "\n")
    with pytest.raises(InvalidInput, match=rf"the engines' API key {key_file}: the key must be one token .*leading ~"):
        check_env_key(key_file, "the engines' API key")
    # the inventory refuses it too (validate, plan, deploy), on the line of kimi_api_key_file
    doc = yaml.safe_load((ROOT / "inventories/a3-pd.yml").read_text())
    doc["all"]["vars"]["kimi_api_key_file"] = str(key_file)
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    with pytest.raises(InvalidInput) as exc:
        load_inventory(tmp_path / "inv.yml")
    assert any("all.vars: kimi_api_key_file: the key must be one token" in d for d in exc.value.details)


def test_a_kimictl_made_engine_key_someone_edited_is_refused_before_it_reaches_a_host(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    from fake_sessions import held_keys

    from kimictl import key_readback
    from kimictl.cluster_secrets import cluster_secret_path

    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr(key_readback, "Sessions", held_keys({}))  # the cluster holds no engine key yet
    doc = yaml.safe_load((ROOT / "inventories/a3-pd.yml").read_text())
    doc["all"]["vars"]["kimi_api_key_file"] = str(_key_file(tmp_path, "sk-client-1234\n"))
    (tmp_path / "inv.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    inv = load_inventory(tmp_path / "inv.yml")
    made = engine_key_file(inv, pd=True, create=True)
    assert made == cluster_secret_path(inv.cluster.name, "engine-api-key")
    made.write_text("k3y $(touch /tmp/x)\n")
    with pytest.raises(InvalidInput, match=rf"the engines' API key {made}: the key must be one token"):
        engine_key_file(inv, pd=True, create=True)
