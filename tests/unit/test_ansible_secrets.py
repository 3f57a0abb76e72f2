"""No secret reaches ansible-runner's command line, environment or artifacts: two real playbook runs in one run
directory (the second is where runner used to put extravars on the command line), with hub tokens in our
environment and a secret in the extravars."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from kimictl.ansible import build_run_spec, run_playbook, runner_env

TOKEN = "hf_canaryEnvToken5d41402abc4b2a76"
SECRET = "peer-key-canary-7e2f9c31d0"
PLAYBOOK = """- hosts: all
  gather_facts: false
  tasks:
    - name: Use the secret the way playbooks do (stdin, no_log)
      ansible.builtin.command:
        cmd: cat
        stdin: "{{ kimi.payload }}"
      no_log: true
      register: got
      changed_when: false
    - name: The secret arrived
      ansible.builtin.assert:
        that: [got.stdout == kimi.payload]
      no_log: true
"""


def test_two_runs_leave_no_secret_in_argv_env_or_artifacts(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("MODELSCOPE_API_TOKEN", TOKEN)
    monkeypatch.setenv("ANSIBLE_BECOME_PASS", TOKEN)
    playbook = tmp_path / "p.yml"
    playbook.write_text(PLAYBOOK)
    inventory = tmp_path / "inv.yml"
    inventory.write_text(f"all:\n  hosts:\n    local1:\n      ansible_connection: local\n"
                         f"      ansible_python_interpreter: {sys.executable}\n")
    run_dir = tmp_path / "run"
    # a run killed mid-playbook left its extravars; one that is running now has just written its own
    killed, running = (tmp_path / d / "ansible/01-x/env/extravars" for d in ("killed-run", "running-run"))
    for f, text in ((killed, SECRET), (running, "{}")):
        f.parent.mkdir(parents=True)
        f.write_text(text)
    os.utime(killed, (time.time() - 3600, time.time() - 3600))
    results = [run_playbook(build_run_spec(run_dir, str(playbook), inventory, {"kimi": {"payload": SECRET}},
                                           ident=ident, hosts=["local1"]))
               for ident in ("01-first", "02-second")]
    assert [r.ok for r in results] == [True, True], [r.failures for r in results]
    # runner records the exact argv and environment it ran with in artifacts/<ident>/command
    leaks = subprocess.run(["grep", "-rlF", "-e", TOKEN, "-e", SECRET, str(tmp_path)], capture_output=True,
                           text=True, check=False)
    assert leaks.stdout == ""
    for r in results:
        command = json.loads((Path(r.artifacts) / "command").read_text())
        assert "-e" in command["command"] and command["command"][command["command"].index("-e") + 1].startswith("@")
        assert command["env"]["HOME"] and "HF_TOKEN" not in command["env"]
        assert (Path(r.artifacts).parents[1] / "env").stat().st_mode & 0o077 == 0
    assert Path(results[0].artifacts).parents[1] != Path(results[1].artifacts).parents[1]
    assert not killed.exists() and running.exists()


def test_runner_env_keeps_what_runner_and_we_set_and_drops_our_secrets():
    outer = {"PATH": "/usr/bin", "HOME": "/root", "HF_TOKEN": "t", "AWS_SECRET_ACCESS_KEY": "s", "LC_ALL": "C",
             "ANSIBLE_CONFIG": "/etc/a.cfg", "ANSIBLE_BECOME_PASS": "p", "ANSIBLE_VAULT_PASSWORD_FILE": "/v",
             "ANSIBLE_HOST_KEY_CHECKING": "False", "SSH_AUTH_SOCK": "/run/agent"}
    own = {"ANSIBLE_HOST_KEY_CHECKING": "True", "PATH": "/venv/bin:/usr/bin"}
    env = {**outer, **own, "ANSIBLE_STDOUT_CALLBACK": "awx_display", "AWX_ISOLATED_DATA_DIR": "/a"}
    assert runner_env(env, own, outer) == {
        "PATH": "/venv/bin:/usr/bin", "HOME": "/root", "LC_ALL": "C", "ANSIBLE_CONFIG": "/etc/a.cfg",
        "ANSIBLE_VAULT_PASSWORD_FILE": "/v", "ANSIBLE_HOST_KEY_CHECKING": "True", "SSH_AUTH_SOCK": "/run/agent",
        "ANSIBLE_STDOUT_CALLBACK": "awx_display", "AWX_ISOLATED_DATA_DIR": "/a"}


def test_build_run_spec_puts_host_key_options_first_and_a_private_dir_per_run(tmp_path):
    spec = build_run_spec(tmp_path, "engines.yml", tmp_path / "inv.yml", {}, ident="03-engines", hosts=["h"],
                          host_key_args="-o UserKnownHostsFile=/k -o StrictHostKeyChecking=accept-new")
    assert spec.private_data_dir == str(tmp_path / "ansible" / "03-engines")
    assert spec.envvars["ANSIBLE_SSH_ARGS"].startswith("-o UserKnownHostsFile=/k -o StrictHostKeyChecking=accept-new "
                                                       "-C -o ControlMaster=auto")
