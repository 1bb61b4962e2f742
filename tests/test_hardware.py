"""Device catalog lookups, cluster construction and user cluster files."""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest

from planner.contract.hardware import (
    DEVICE_CATALOG,
    PLAUSIBLE_RANGES,
    check_plausible,
    DeviceSpec,
    get_device,
    list_devices,
    load_cluster_file,
    make_cluster,
    override_device,
)
from planner.contract.units import GIB


def test_catalog_has_the_required_devices_with_datasheet_numbers():
    h100 = get_device("h100-80gb")
    assert h100.peak_bf16_flops == pytest.approx(989.5e12)
    assert h100.memory_bytes == 80 * 2**30
    assert h100.memory_bandwidth == 3.35e12
    assert h100.intra_node_bandwidth == 450e9  # 900 GB/s NVLink 4, bidirectional
    assert h100.inter_node_bandwidth == 50e9  # one 400 Gb/s NDR NIC per GPU
    assert get_device("a100-80gb").peak_bf16_flops == 312e12
    assert get_device("h200-141gb").memory_bandwidth == 4.8e12
    assert get_device("b200").peak_bf16_flops == pytest.approx(2.25e15)
    assert {"h100-80gb", "h200-141gb", "a100-80gb", "b200", "cpu"} <= set(DEVICE_CATALOG)


@pytest.mark.parametrize("name", list(DEVICE_CATALOG))
def test_every_device_is_complete_and_cited(name):
    spec = get_device(name)
    assert spec.name == name
    numbers = {f.name: getattr(spec, f.name) for f in fields(DeviceSpec) if f.type in ("int", "float")}
    may_be_zero = {"kernel_launch_latency", "host_overlap"}  # a CPU runs kernels as calls, on the host itself
    assert all(v > 0 for k, v in numbers.items() if k not in may_be_zero), numbers
    assert all(v >= 0 for v in numbers.values()), numbers
    assert spec.source and (spec.name == "cpu" or "datasheet" in spec.source)


def test_cpu_numbers_are_declared_placeholders():
    assert "PLACEHOLDER" in get_device("cpu").source


@pytest.mark.parametrize(
    ("alias", "name"),
    [("h100", "h100-80gb"), ("H100-SXM-80GB", "h100-80gb"), ("h100_sxm5", "h100-80gb"), ("A100", "a100-80gb"),
     ("a100-sxm4-80gb", "a100-80gb"), ("H200", "h200-141gb"), ("B200", "b200"), (" cpu ", "cpu")],
)
def test_aliases(alias, name):
    assert get_device(alias).name == name


def test_unknown_device_suggests_close_names():
    with pytest.raises(ValueError, match=r"unknown device 'h10'; did you mean h100") as info:
        get_device("h10")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="known: h100-80gb, h200-141gb, a100-80gb, b200, cpu"):
        get_device("tpu-v5")


def test_list_devices_matches_the_catalog():
    listed = {name: aliases for name, aliases, _ in list_devices()}
    assert list(listed) == list(DEVICE_CATALOG)
    assert "h100" in listed["h100-80gb"]


def test_make_cluster_defaults_to_the_devices_node_size():
    cluster = make_cluster("h100", 20)
    assert (cluster.device.name, cluster.devices_per_node, cluster.num_nodes) == ("h100-80gb", 8, 3)
    assert make_cluster(get_device("cpu"), 4, devices_per_node=2).num_nodes == 2
    with pytest.raises(ValueError, match=">= 1"):
        make_cluster("h100", 0)


def test_cluster_file_overrides_catalog_fields_json(tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"device": "H100", "inter_node_bandwidth": 25e9, "devices_per_node": 4}))
    spec, overrides = load_cluster_file(str(path))
    assert overrides == {"inter_node_bandwidth": 25e9, "devices_per_node": 4}
    assert (spec.name, spec.inter_node_bandwidth, spec.devices_per_node) == ("h100-80gb", 25e9, 4)
    assert spec.memory_bandwidth == get_device("h100").memory_bandwidth
    assert f"overridden by {path}: devices_per_node, inter_node_bandwidth" in spec.source


def test_cluster_file_yaml_reads_numbers_written_as_strings(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("device: a100-80gb\ninter_node_bandwidth: 12.5e9\nmemory_bytes: 40e9\n")
    spec, _ = load_cluster_file(str(path))
    assert (spec.inter_node_bandwidth, spec.memory_bytes) == (12.5e9, 40_000_000_000)
    assert isinstance(spec.memory_bytes, int)


def test_cluster_file_defines_a_new_device(tmp_path):
    values = {"name": "mi300x", "peak_bf16_flops": 1307e12, "memory_bytes": 192 * GIB, "memory_bandwidth": 5.3e12,
              "intra_node_bandwidth": 64e9, "intra_node_latency": 5e-6, "inter_node_bandwidth": 50e9,
              "inter_node_latency": 1e-5, "devices_per_node": 8, "kernel_launch_latency": 4e-6,
              "host_overlap": 0.9}
    path = tmp_path / "mi300x.yml"
    path.write_text("\n".join(f"{k}: {v}" for k, v in values.items()))
    spec, overrides = load_cluster_file(str(path))
    assert spec == DeviceSpec(**values, source=f"user-defined in {path}")
    assert overrides == values


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"device": "h100", "inter_node_bw": 1}', "unknown field 'inter_node_bw'; did you mean inter_node_bandwidth"),
        ('{"device": "h1000"}', "unknown device 'h1000'"),
        ('{"device": "h100", "devices_per_node": 2.5}', "devices_per_node must be a whole number"),
        ('{"device": "h100", "memory_bandwidth": -1}', "memory_bandwidth must be a positive number"),
        ('{"device": "h100", "intra_node_latency": "fast"}', "intra_node_latency must be a non-negative number"),
        ('{"device": 3}', "device must be a catalog name"),
        ('{"name": "x", "peak_bf16_flops": 1e12}', "missing: memory_bytes, memory_bandwidth"),
        ("[1, 2]", "must hold a mapping"),
        ("{not json", "does not parse"),
    ],
)
def test_bad_cluster_files_give_one_line_errors(tmp_path, content, message):
    path = tmp_path / "cluster.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as info:
        load_cluster_file(str(path))
    assert "\n" not in str(info.value)


def test_unreadable_and_unparsable_yaml_files(tmp_path):
    with pytest.raises(ValueError, match="cannot read cluster file"):
        load_cluster_file(str(tmp_path / "missing.yaml"))
    path = tmp_path / "bad.yaml"
    path.write_text("device: [h100\n")
    with pytest.raises(ValueError, match="does not parse") as info:
        load_cluster_file(str(path))
    assert "\n" not in str(info.value)


def test_override_device_keeps_unset_fields_and_records_the_origin():
    base = get_device("cpu")
    measured = override_device(base, {"peak_bf16_flops": 2e11, "source": "profile cpu/tiny"}, "profile")
    assert (measured.peak_bf16_flops, measured.source, measured.memory_bytes) == (2e11, "profile cpu/tiny",
                                                                                  base.memory_bytes)
    assert override_device(base, {}, "nothing") is base


@pytest.mark.parametrize("name", list(DEVICE_CATALOG))
def test_catalog_devices_lie_inside_the_plausible_ranges(name):
    spec = get_device(name)
    for field, bounds in PLAUSIBLE_RANGES.items():
        assert bounds.low <= getattr(spec, field) <= bounds.high, field


@pytest.mark.parametrize(("field", "value", "message"), [
    ("inter_node_bandwidth", 25, "inter_node_bandwidth = 25 is outside the plausible range 1e+07 to 1e+14 bytes/s"),
    ("peak_bf16_flops", 1e-300, "peak_bf16_flops = 1e-300 is outside the plausible range 1e+09 to 1e+17 FLOP/s"),
    ("intra_node_latency", 3.4, "intra_node_latency = 3.4 is outside the plausible range 0 to 0.01 seconds"),
    ("devices_per_node", 4096, "devices_per_node = 4096 is outside the plausible range 1 to 1024 devices"),
])
def test_cluster_file_values_outside_the_plausible_range_name_field_value_unit_and_range(field, value, message,
                                                                                         tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"device": "h100-80gb", field: value}))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        load_cluster_file(str(path))
    assert "\n" not in str(info.value)


def test_the_unit_hint_converts_the_value():
    hint = "(written in us or ms or ns? 3.4 us = 3.4e-06, 3.4 ms = 0.0034, 3.4 ns = 3.4e-09 seconds)"
    with pytest.raises(ValueError, match=re.escape(hint)):
        check_plausible("intra_node_latency", 3.4, "f.json")
