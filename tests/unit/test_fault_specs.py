"""Fault SPEC parsing and the faults.json documents it produces."""

from __future__ import annotations

import pytest

from kimictl.errors import InvalidInput
from kimictl.sandbox.faults import Fault, apply_to_doc, parse_fault

HOSTS = ["atlas-01", "atlas-02"]


@pytest.mark.parametrize(("spec", "expected"), [
    ("npu-unhealthy:atlas-01:3", Fault("npu-unhealthy", "atlas-01", 3)),
    ("link-down:atlas-02:15", Fault("link-down", "atlas-02", 15)),
    ("driver-mismatch:atlas-01", Fault("driver-mismatch", "atlas-01", "23.0.rc3")),
    ("driver-mismatch:atlas-01:24.1.rc2", Fault("driver-mismatch", "atlas-01", "24.1.rc2")),
    ("small-disk:atlas-01", Fault("small-disk", "atlas-01", "2G")),
    ("small-disk:atlas-01:500M", Fault("small-disk", "atlas-01", "500M")),
    ("host-down:atlas-02", Fault("host-down", "atlas-02", None)),
    ("slow-link:atlas-01:200mbit", Fault("slow-link", "atlas-01", "200mbit")),
    ("cut-route:atlas-01:atlas-02", Fault("cut-route", "atlas-01", "atlas-02")),
    ("engine-crash:atlas-02", Fault("engine-crash", "atlas-02", "*")),
    ("engine-hang:atlas-02:decode", Fault("engine-hang", "atlas-02", "decode")),
    ("port-taken:atlas-01:8000", Fault("port-taken", "atlas-01", 8000)),
    ("kv-pressure:atlas-02", Fault("kv-pressure", "atlas-02", 4)),
    ("kv-pressure:atlas-02:16", Fault("kv-pressure", "atlas-02", 16)),
    ("clear:all", Fault("clear", "all", None)),
    ("clear:atlas-02", Fault("clear", "atlas-02", None)),
])
def test_valid_specs(spec, expected):
    f = parse_fault(spec, HOSTS, 16)
    assert f == expected
    assert parse_fault(f.spec, HOSTS, 16) == f   # .spec round-trips


@pytest.mark.parametrize(("spec", "bad_part"), [
    ("npu-sick:atlas-01:3", "'npu-sick'"),
    ("npu-unhealthy:atlas-09:3", "'atlas-09'"),
    ("npu-unhealthy:atlas-01:16", "'16'"),
    ("npu-unhealthy:atlas-01:x", "'x'"),
    ("npu-unhealthy:atlas-01", "needs NPU"),
    ("link-down:atlas-01:3:4", "'4'"),
    ("slow-link:atlas-01:fast", "'fast'"),
    ("small-disk:atlas-01:lots", "'lots'"),
    ("cut-route:atlas-01:atlas-01", "two different hosts"),
    ("cut-route:atlas-01:atlas-07", "'atlas-07'"),
    ("engine-crash:atlas-01:router", "'router'"),
    ("port-taken:atlas-01:70000", "'70000'"),
    ("kv-pressure:atlas-01:0", "'0'"),
    ("kv-pressure:atlas-01:many", "'many'"),
    ("host-down:all", "'all'"),
    ("host-down", "missing host"),
    ("npu-unhealthy:atlas-01:\u00b2", "'\u00b2'"),         # str.isdigit() says yes to a superscript two
])
def test_bad_specs_name_the_bad_part(spec, bad_part):
    with pytest.raises(InvalidInput) as exc:
        parse_fault(spec, HOSTS, 16)
    assert bad_part in exc.value.message
    assert spec in exc.value.message
    assert exc.value.code == 2


def test_unknown_shape_is_only_checked_when_known():
    assert parse_fault("npu-unhealthy:atlas-05:99").arg == 99


def test_apply_to_doc_builds_the_keys_the_doubles_and_engine_read():
    doc: dict = {}
    for spec in ["npu-unhealthy:atlas-01:3", "npu-unhealthy:atlas-01:3", "link-down:atlas-01:5",
                 "engine-crash:atlas-01:prefill", "engine-hang:atlas-01", "port-taken:atlas-01:8000",
                 "driver-mismatch:atlas-01:1.0", "small-disk:atlas-01:1G", "slow-link:atlas-01:1gbit",
                 "kv-pressure:atlas-01"]:
        doc = apply_to_doc(doc, parse_fault(spec))
    assert doc == {"npu_unhealthy": [3], "link_down": [5], "engine_crash_at_start": ["prefill"],
                   "engine_hang_in_load": ["*"], "port_taken": [8000], "driver_version": "1.0",
                   "small_disk": "1G", "slow_link": "1gbit", "kv_pressure_tokens": 4}


def test_apply_to_doc_does_not_mutate_its_input():
    before = {"npu_unhealthy": [1]}
    after = apply_to_doc(before, parse_fault("npu-unhealthy:atlas-01:2"))
    assert before == {"npu_unhealthy": [1]}
    assert after == {"npu_unhealthy": [1, 2]}
    assert apply_to_doc({}, parse_fault("cut-route:atlas-01:atlas-02"), peer_subnet="127.20.2.0/24") == {
        "cut_routes": ["127.20.2.0/24"]}
