"""The cluster's own keys live on the cluster (issue 34): a control node without its copy reads them back from the
hosts (checked as keys, hosts that disagree refused) and makes one only when every host answered without one; an
operator may supply them (inventory file > environment > the copy > the hosts); the copy is private."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from fake_sessions import held_keys

from kimictl import key_readback
from kimictl.cluster_secrets import (
    ADMIN_KEY,
    ENGINE_KEY,
    cluster_secret_path,
    engine_api_key,
    engine_key_file,
    known_keys,
    proxy_admin_key,
    proxy_admin_key_path,
)
from kimictl.errors import EXIT_FAILED, HostError, InvalidInput, InventoryError
from kimictl.inventory import load_inventory

ROOT = Path(__file__).resolve().parents[2]
PROXY, OTHER = "a3-node-01", "a3-node-02"   # inventories/a3-pd.yml: the proxy runs on the first prefill host
CLUSTER_KEY = "cluster-admin-key-Zq81_x"


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIMICTL_STATE_DIR", str(tmp_path / "state"))
    for spec in (ADMIN_KEY, ENGINE_KEY):
        monkeypatch.delenv(spec.env_var, raising=False)


def _secret(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def _inv(tmp_path: Path, **all_vars):
    doc = yaml.safe_load((ROOT / "inventories/a3-pd.yml").read_text())
    doc["all"]["vars"].update(all_vars)
    path = tmp_path / f"inv-{len(list(tmp_path.glob('inv-*')))}.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_inventory(path)


def _cluster(monkeypatch: pytest.MonkeyPatch, files: dict[str, dict[str, str]], down: tuple[str, ...] = ()) -> list:
    asked: list = []
    monkeypatch.setattr(key_readback, "Sessions", held_keys(files, down, asked))
    return asked


def test_admin_key_is_made_once_private_and_refused_when_readable(tmp_path: Path, monkeypatch) -> None:
    _cluster(monkeypatch, {})   # every host answers: none holds a key (the first deploy)
    inv = _inv(tmp_path)
    assert proxy_admin_key(inv, PROXY) is None  # status and rollout never make one
    key = proxy_admin_key(inv, PROXY, create=True)
    path = proxy_admin_key_path("kimi-a3")
    assert key and len(key) >= 40 and path.read_text() == key + "\n"
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert proxy_admin_key(inv, PROXY, create=True) == key == proxy_admin_key(inv, PROXY)
    assert proxy_admin_key(_inv(tmp_path, kimi_cluster="c2"), PROXY, create=True) != key
    assert sorted(p.name for p in path.parent.iterdir()) == ["proxy-admin-key"]  # no temporary file left
    path.chmod(0o644)
    with pytest.raises(InvalidInput, match="readable by others"):
        proxy_admin_key(inv, PROXY)


def test_an_empty_state_takes_the_key_the_cluster_holds_and_makes_none(tmp_path: Path, monkeypatch) -> None:
    asked = _cluster(monkeypatch, {PROXY: {"proxy-admin-key": CLUSTER_KEY + "\n"}})
    inv = _inv(tmp_path)
    assert proxy_admin_key(inv, PROXY, create=True) == CLUSTER_KEY   # a deploy from a fresh CI runner, too
    assert asked == [(PROXY, "proxy-admin-key")]   # the proxy host only, one read
    copy = proxy_admin_key_path("kimi-a3")
    assert copy.read_text() == CLUSTER_KEY + "\n" and copy.stat().st_mode & 0o777 == 0o600
    assert proxy_admin_key(inv, PROXY) == CLUSTER_KEY and len(asked) == 1   # the copy answers from now on
    copy.unlink()   # the copy may be deleted any time: the cluster is asked again
    assert proxy_admin_key(inv, PROXY) == CLUSTER_KEY and len(asked) == 2


@pytest.mark.parametrize("create", [False, True])
def test_an_unreachable_host_without_a_copy_is_an_error_and_no_key_is_made(tmp_path: Path, monkeypatch,
                                                                           create: bool) -> None:
    _cluster(monkeypatch, {}, down=(PROXY,))
    inv = _inv(tmp_path)
    with pytest.raises(HostError) as exc:
        proxy_admin_key(inv, PROXY, create=create)
    assert exc.value.code == EXIT_FAILED and exc.value.host == PROXY and exc.value.step == "keys"
    assert "cannot read the proxy admin key back" in exc.value.message
    assert "Connection refused" in exc.value.render() and "KIMICTL_PROXY_ADMIN_KEY" in exc.value.hint
    assert not (tmp_path / "state").exists() or not any((tmp_path / "state").rglob("*key*"))


def test_engine_key_read_back_from_every_host_refuses_hosts_that_disagree(tmp_path: Path, monkeypatch) -> None:
    client = _secret(tmp_path, "client", "sk-client-1\n")
    inv = _inv(tmp_path, kimi_api_key_file=str(client))
    _cluster(monkeypatch, {PROXY: {"engine-api-key.env": "VLLM_API_KEY=engine-a\n"},
                           OTHER: {"engine-api-key.env": "VLLM_API_KEY=engine-b\n"}})
    with pytest.raises(HostError) as exc:
        engine_key_file(inv, pd=True, create=True)
    assert f"{PROXY} / {OTHER}" in exc.value.message and exc.value.step == "keys"
    assert "engine-a" not in exc.value.render() and "engine-b" not in exc.value.render()   # keys are never shown
    assert not cluster_secret_path("kimi-a3", ENGINE_KEY.name).exists()
    # one host holds it, the other not yet (a host joining the cluster): the cluster's key, kept for every host
    _cluster(monkeypatch, {OTHER: {"engine-api-key.env": "VLLM_API_KEY=engine-b\n"}})
    path = engine_key_file(inv, pd=True, create=True)
    assert path and path.read_text() == "engine-b\n" and engine_api_key(inv, pd=True) == "engine-b"


def test_a_hosts_client_key_is_not_taken_for_the_pd_engine_key(tmp_path: Path, monkeypatch) -> None:
    """Colocated engines hold the clients' key: a cluster that becomes P/D gets an engine key of its own."""
    client = _secret(tmp_path, "client", "sk-client-1\n")
    inv = _inv(tmp_path, kimi_api_key_file=str(client))
    _cluster(monkeypatch, {h: {"engine-api-key.env": "VLLM_API_KEY=sk-client-1\n"} for h in (PROXY, OTHER)})
    assert engine_api_key(inv, pd=True) is None
    path = engine_key_file(inv, pd=True, create=True)
    assert path and path.read_text().strip() not in ("", "sk-client-1")


@pytest.mark.parametrize("text", ["two words", "key\nsecond-line", "k" * (100 << 10), "", "$(reboot)"])
def test_a_key_read_back_that_is_no_key_is_refused_naming_the_host(tmp_path: Path, monkeypatch, text: str) -> None:
    _cluster(monkeypatch, {PROXY: {"proxy-admin-key": text}})
    with pytest.raises(HostError) as exc:
        proxy_admin_key(_inv(tmp_path), PROXY, create=True)
    assert exc.value.host == PROXY and exc.value.step == "keys" and "holds no valid key" in exc.value.message
    assert len(exc.value.render()) < 2000 and not cluster_secret_path("kimi-a3", ADMIN_KEY.name).exists()


@pytest.mark.parametrize("text", ["engine-a\n", "VLLM_API_KEY=engine-a\nOTHER=1\n", "VLLM_API_KEY=a b\n",
                                  "export VLLM_API_KEY=engine-a\n"])
def test_the_engine_env_file_is_parsed_strictly(tmp_path: Path, monkeypatch, text: str) -> None:
    client = _secret(tmp_path, "client", "sk-client-1\n")
    _cluster(monkeypatch, {OTHER: {"engine-api-key.env": text}})
    with pytest.raises(HostError) as exc:
        engine_api_key(_inv(tmp_path, kimi_api_key_file=str(client)), pd=True)
    assert exc.value.host == OTHER and "engine-api-key.env" in exc.value.message


def test_an_answer_without_the_mark_is_refused() -> None:
    with pytest.raises(HostError, match="without kimictl's mark") as exc:
        key_readback.parse_answer("h1", "/x", "sk-a-key-without-the-mark\n", "the proxy admin key", False)
    assert "sk-a-key" not in exc.value.render()
    with pytest.raises(HostError, match="not a regular file"):
        key_readback.parse_answer("h1", "/x", f"{key_readback.MARK}other\n", "the proxy admin key", False)


def test_supplied_keys_come_first_inventory_file_then_environment(tmp_path: Path, monkeypatch) -> None:
    asked = _cluster(monkeypatch, {PROXY: {"proxy-admin-key": CLUSTER_KEY}})
    inv_file = _secret(tmp_path, "admin", "from-the-inventory-file\n")
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "from-the-environment")
    assert proxy_admin_key(_inv(tmp_path, kimi_proxy_admin_key_file=str(inv_file)), PROXY) == "from-the-inventory-file"
    inv = _inv(tmp_path)
    assert proxy_admin_key(inv, PROXY) == "from-the-environment" and asked == []   # the hosts are not asked
    assert not proxy_admin_key_path("kimi-a3").exists()   # only talking: the copy stays as it was
    assert proxy_admin_key(inv, PROXY, create=True) == "from-the-environment"   # a deploy installs it ...
    assert proxy_admin_key_path("kimi-a3").read_text() == "from-the-environment\n"   # ... and keeps it as the copy
    monkeypatch.delenv("KIMICTL_PROXY_ADMIN_KEY")
    assert proxy_admin_key(inv, PROXY) == "from-the-environment" and asked == []   # the copy before the cluster
    proxy_admin_key_path("kimi-a3").unlink()
    assert proxy_admin_key(inv, PROXY) == CLUSTER_KEY and len(asked) == 1


def test_an_invalid_supplied_key_is_refused_without_showing_it(tmp_path: Path, monkeypatch) -> None:
    _cluster(monkeypatch, {})
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "secret with blanks")
    with pytest.raises(InvalidInput) as exc:
        proxy_admin_key(_inv(tmp_path), PROXY)
    assert exc.value.message.startswith("KIMICTL_PROXY_ADMIN_KEY: ") and "secret" not in exc.value.message
    monkeypatch.setenv("KIMICTL_ENGINE_API_KEY", "engine-from-ci")
    client = _secret(tmp_path, "client", "sk-client-1\n")
    assert engine_api_key(_inv(tmp_path, kimi_api_key_file=str(client)), pd=True) == "engine-from-ci"


def test_the_inventory_checks_the_key_files_like_the_client_key(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.write_text("k1\n")
    loose.chmod(0o644)
    with pytest.raises(InventoryError) as exc:
        _inv(tmp_path, kimi_proxy_admin_key_file=str(loose))
    assert any("all.vars: kimi_proxy_admin_key_file" in d and "readable by others" in d for d in exc.value.details)
    bad = _secret(tmp_path, "bad", "two words\n")
    with pytest.raises(InventoryError) as exc:
        _inv(tmp_path, kimi_engine_api_key_file=str(bad))
    assert any("kimi_engine_api_key_file: the key must be one token" in d for d in exc.value.details)
    assert any("set kimi_api_key_file too" in d for d in exc.value.details)
    with pytest.raises(InventoryError, match="invalid inventory"):
        _inv(tmp_path, kimi_proxy_admin_key_file="relative/key")


def test_logs_redact_the_keys_they_can_get_and_go_on_without_the_others(tmp_path: Path, monkeypatch) -> None:
    client = _secret(tmp_path, "client", "sk-client-1\n")
    inv = _inv(tmp_path, kimi_api_key_file=str(client))
    _cluster(monkeypatch, {PROXY: {"proxy-admin-key": CLUSTER_KEY}}, down=(OTHER,))
    assert known_keys(inv) == ["sk-client-1", CLUSTER_KEY]   # the engine key: a host did not answer


def test_the_read_command_answers_as_parse_answer_expects_in_a_real_shell(tmp_path: Path) -> None:
    import subprocess

    def ask(path: Path, env_line: bool = False) -> str | None:
        out = subprocess.run(["sh", "-c", key_readback.read_command(str(path))], capture_output=True, text=True,
                             check=True).stdout
        return key_readback.parse_answer("h1", str(path), out, "the key", env_line)

    assert ask(tmp_path / "missing") is None
    assert ask(_secret(tmp_path, "admin", "  k-1_x\n")) == "k-1_x"
    assert ask(_secret(tmp_path, "env", "VLLM_API_KEY=e-2\n"), env_line=True) == "e-2"
    (tmp_path / "dir").mkdir()
    with pytest.raises(HostError, match="not a regular file"):
        ask(tmp_path / "dir")
    with pytest.raises(HostError, match="at most 65536"):
        ask(_secret(tmp_path, "big", "k" * (100 << 10)))   # only the first 64 KiB + 1 byte travel


def test_a_copy_the_front_refuses_is_dropped_and_the_clusters_key_read_back(tmp_path: Path, monkeypatch) -> None:
    """The admin key was rotated from another control node: this node's copy is stale. Status, heal and rollout ask
    the front with it, get 403, drop the copy and read the cluster's key back (no 403 reaches the user); a key the
    front takes, or one the operator supplies, is used as it is."""
    from fake_sessions import held_keys

    from kimictl import key_readback
    from kimictl.cluster_secrets import ADMIN_KEY, cluster_secret_path, keep_copy
    from kimictl.routers import front_admin_key

    inv = _inv(tmp_path)
    proxy = inv.hosts[0].name
    monkeypatch.setattr(key_readback, "Sessions", held_keys({proxy: {"proxy-admin-key": "rotated-elsewhere\n"}}))
    keep_copy(inv.cluster.name, ADMIN_KEY, "the-stale-copy", replace=True)
    asked: list[str | None] = []

    class Front:
        def http_get(self, url: str, timeout: float = 3.0, api_key: str | None = None) -> tuple[int, str]:
            asked.append(api_key)
            return (200, "{}") if api_key == "rotated-elsewhere" else (403, "router admin paths need the admin key")

    assert front_admin_key(inv, proxy, "10.0.0.1", 8000, http=Front()) == "rotated-elsewhere"
    assert asked == ["the-stale-copy"]
    assert cluster_secret_path(inv.cluster.name, ADMIN_KEY.name).read_text() == "rotated-elsewhere\n"
    assert front_admin_key(inv, proxy, "10.0.0.1", 8000, http=Front()) == "rotated-elsewhere"   # taken: kept
    monkeypatch.setenv("KIMICTL_PROXY_ADMIN_KEY", "operators-key")
    assert front_admin_key(inv, proxy, "10.0.0.1", 8000, http=Front()) == "operators-key"
    assert asked == ["the-stale-copy", "rotated-elsewhere"]   # a supplied key is not second-guessed
