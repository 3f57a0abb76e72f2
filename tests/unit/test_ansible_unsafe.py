"""Extra vars are data, never Jinja: a host that reports a string holding a template (a process id, an old command,
a release name) cannot make ansible-core evaluate it on the control node. One real playbook run through
kimictl.ansible (connection local)."""

from __future__ import annotations

import json
import sys

import yaml

from kimictl.ansible import build_run_spec, extravars_yaml, run_playbook

PLAYBOOK = """- hosts: all
  gather_facts: false
  tasks:
    - name: Write the value the way tasks use extra vars
      ansible.builtin.copy:
        dest: "{{ kimi.out }}"
        content: "{{ kimi.value }}"
    - name: Write every extra var back
      ansible.builtin.copy:
        dest: "{{ kimi.out }}.json"
        content: "{{ kimi | to_json }}"
"""


def test_a_jinja_payload_in_extra_vars_is_written_literally_and_never_runs(tmp_path):
    marker, key_marker = tmp_path / "PWNED", tmp_path / "PWNED-KEY"
    payload = f"x{{{{ lookup('pipe', 'touch {marker}') }}}}"
    odd = ['a"b\nc\r\0d', "ünï €", "{% raw %}", "{{ '{{' }}", "#x", "*a", "&b !c", "", " sp ", "\u2028\x85", "a" * 300]
    kimi = {"out": str(tmp_path / "out"), "value": payload, "odd": odd, "n": None, "t": True, "i": 3, "f": 1.5,
            "m": {f"k{{{{ lookup('pipe', 'touch {key_marker}') }}}}": ["", payload], "": 1}, "tuple": ("a", 1)}
    playbook = tmp_path / "p.yml"
    playbook.write_text(PLAYBOOK)
    inventory = tmp_path / "inv.yml"
    inventory.write_text(f"all:\n  hosts:\n    local1:\n      ansible_connection: local\n"
                         f"      ansible_python_interpreter: {sys.executable}\n")
    res = run_playbook(build_run_spec(tmp_path / "run", str(playbook), inventory, {"kimi": kimi}, ident="01-x",
                                      hosts=["local1"]))
    assert res.ok, res.failures
    assert (tmp_path / "out").read_text() == payload
    assert not marker.exists() and not key_marker.exists()
    # every value arrives as it was (what JSON made of it), nothing templated, nothing lost (empty strings stay "")
    assert json.loads((tmp_path / "out.json").read_text()) == json.loads(json.dumps(kimi))


def test_every_extravars_string_is_tagged_unsafe_but_the_empty_one():
    tags: list[tuple[str, str]] = []

    class Loader(yaml.SafeLoader):
        pass

    def unsafe(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
        tags.append(("unsafe", node.value))
        return node.value

    Loader.add_constructor("!unsafe", unsafe)
    data = {"kimi": {"id": "x{{ 1 }}", "ids": ["p{% if 1 %}", ""], "n": 2, "hosts": {"h1": {"release": "ab"}}}}
    text = extravars_yaml(data)
    assert yaml.load(text, Loader=Loader) == data
    assert sorted(v for _, v in tags) == sorted(["kimi", "id", "x{{ 1 }}", "ids", "p{% if 1 %}", "n", "hosts", "h1",
                                                 "release", "ab"])
    assert '""' in text and '!unsafe ""' not in text
