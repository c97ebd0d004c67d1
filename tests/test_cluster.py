"""Tests for plait.spec.cluster: shorthand, YAML files, speed factors and error messages."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import expect_error

from plait.spec.cluster import (
    DGX_LINKS,
    GB,
    GIB,
    GPUS,
    TFLOPS,
    Cluster,
    Link,
    dgx,
    from_yaml,
    load_cluster,
)

# ---- shorthand -----------------------------------------------------------------------------------------

# type: (peak TFLOP/s, GiB of memory roughly, NVLink GB/s, network GB/s)
EXPECTED = {
    "A100-40GB": (312, 40, 300, 25),
    "A100-80GB": (312, 80, 300, 25),
    "H100-80GB": (989, 79.6, 450, 50),
    "H200-141GB": (989, 140.4, 450, 50),
    "A800-80GB": (312, 80, 200, 25),
    "GH200-96GB": (989, 96, 450, 50),
}


@pytest.mark.parametrize("gpu_type", sorted(EXPECTED))
def test_shorthand_every_type(gpu_type: str) -> None:
    peak, mem_gib, nvlink, net = EXPECTED[gpu_type]
    c = load_cluster(f"2x8x{gpu_type}")
    assert c.name == f"2x8x{gpu_type}"
    assert (c.nodes, c.gpus_per_node, c.world_size) == (2, 8, 16)
    assert c.gpu is GPUS[gpu_type] and c.gpu.name == gpu_type
    assert c.gpu.peak_flops == peak * TFLOPS
    assert c.gpu.peak_tf32_flops == pytest.approx(c.gpu.peak_flops / 2, rel=0.01)
    assert c.gpu.memory_bytes / GIB == pytest.approx(mem_gib, rel=0.005)
    assert c.intra.bandwidth == nvlink * GB and c.inter.bandwidth == net * GB
    assert c.intra.bandwidth > c.inter.bandwidth
    assert c.intra.latency < c.inter.latency
    assert (c.intra, c.inter) == DGX_LINKS[gpu_type]
    assert c.speed == () and all(c.speed_of(r) == 1.0 for r in range(16))
    assert c == dgx(2, 8, gpu_type)


def test_gpu_types_differ_where_they_should() -> None:
    a40, a80, h100, h200 = (GPUS[t] for t in ("A100-40GB", "A100-80GB", "H100-80GB", "H200-141GB"))
    assert a40.memory_bytes < a80.memory_bytes and h100.memory_bytes < h200.memory_bytes
    assert a40.hbm_bandwidth < a80.hbm_bandwidth < h100.hbm_bandwidth < h200.hbm_bandwidth
    assert a80.sm_count == 108 and h100.sm_count == 132
    assert a80.memory_bytes == 80 * GIB and a40.memory_bytes == 40 * GIB
    a_links, h_links = DGX_LINKS["A100-80GB"], DGX_LINKS["H100-80GB"]
    assert a_links != h_links
    assert h_links[0].bandwidth == 1.5 * a_links[0].bandwidth and h_links[1].bandwidth == 2 * a_links[1].bandwidth


def test_world_size_and_node_of() -> None:
    c = load_cluster("192x8xA100-80GB")
    assert c.world_size == 1536 and c.nodes == 192 and c.gpus_per_node == 8
    assert [c.node_of(r) for r in (0, 7, 8, 15, 16, 1535)] == [0, 0, 1, 1, 2, 191]
    odd = load_cluster("3x4xH100-80GB")
    assert odd.world_size == 12
    assert [odd.node_of(r) for r in range(12)] == [0] * 4 + [1] * 4 + [2] * 4


def test_single_device() -> None:
    c = load_cluster("1x1xH200-141GB")
    assert c.world_size == 1 and c.node_of(0) == 0


# ---- YAML ------------------------------------------------------------------------------------------------

def same_link(a: Link, bandwidth: float, latency: float) -> bool:
    return a.bandwidth == pytest.approx(bandwidth, rel=1e-12) and a.latency == pytest.approx(latency, rel=1e-12)


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_yaml_preset_gpu(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "name: lab\nnodes: 2\ngpus_per_node: 4\ngpu: H100-80GB\n")
    c = load_cluster(str(p))
    assert c.name == "lab" and c.world_size == 8 and c.gpu is GPUS["H100-80GB"]
    assert (c.intra, c.inter) == DGX_LINKS["H100-80GB"]
    assert c.speed == ()
    assert from_yaml(p) == c


def test_yaml_preset_gpu_with_link_override(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yml", "nodes: 4\ngpus_per_node: 8\ngpu: A100-40GB\n"
                                 "inter: {bandwidth_gbps: 12.5, latency_us: 20}\n")
    c = load_cluster(str(p))
    assert c.name == "cluster"  # default name
    assert c.intra == DGX_LINKS["A100-40GB"][0]
    assert same_link(c.inter, 12.5 * GB, 20e-6)


def test_yaml_custom_gpu_table(tmp_path: Path) -> None:
    text = """
name: homebrew
nodes: 2
gpus_per_node: 4
gpu:
  name: RTX-4090
  peak_tflops: 165
  memory_gib: 24
  hbm_gbps: 1008
  sm_count: 128
intra: {bandwidth_gbps: 32, latency_us: 5}
inter: {bandwidth_gbps: 12.5, latency_us: 10}
"""
    c = load_cluster(str(write(tmp_path, "c.yaml", text)))
    assert c.name == "homebrew" and c.world_size == 8
    g = c.gpu
    assert g.name == "RTX-4090" and g.peak_flops == 165 * TFLOPS
    assert g.peak_tf32_flops == 82.5 * TFLOPS  # half of the 16-bit peak when not given
    assert g.memory_bytes == 24 * GIB and g.hbm_bandwidth == 1008 * GB and g.sm_count == 128
    assert same_link(c.intra, 32 * GB, 5e-6) and same_link(c.inter, 12.5 * GB, 10e-6)


def test_yaml_custom_gpu_explicit_tf32(tmp_path: Path) -> None:
    text = ("nodes: 1\ngpus_per_node: 2\ngpu: {name: X, peak_tflops: 100, peak_tf32_tflops: 70, memory_gib: 8,"
            " hbm_gbps: 500}\nintra: {bandwidth_gbps: 10, latency_us: 1}\ninter: {bandwidth_gbps: 1, latency_us: 1}\n")
    c = load_cluster(str(write(tmp_path, "c.yaml", text)))
    assert c.gpu.peak_tf32_flops == 70 * TFLOPS and c.gpu.sm_count == 108


def test_yaml_speed_factors(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\nspeed: {3: 2.0, 7: 1.5}\n")
    c = load_cluster(str(p))
    assert len(c.speed) == 8
    assert [c.speed_of(r) for r in range(8)] == [1, 1, 1, 2.0, 1, 1, 1, 1.5]


def test_custom_gpu_without_links(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: 1\ngpus_per_node: 2\n"
                                  "gpu: {name: X, peak_tflops: 100, memory_gib: 8, hbm_gbps: 500}\n")
    expect_error(lambda: load_cluster(str(p)), "intra", "inter")


# ---- errors ------------------------------------------------------------------------------------------------

def test_unknown_type_shorthand() -> None:
    expect_error(lambda: load_cluster("2x8xMI300X-192GB"), "MI300X-192GB", "A100-80GB", "H200-141GB")


def test_unknown_type_dgx() -> None:
    expect_error(lambda: dgx(1, 8, "MI300X"), "MI300X")


def test_unknown_type_yaml(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: MI300X\n")
    expect_error(lambda: load_cluster(str(p)), "MI300X", str(p))


def test_not_a_cluster() -> None:
    expect_error(lambda: load_cluster("eight-gpus"), "eight-gpus", "NODESxGPUSxTYPE")
    expect_error(lambda: load_cluster("2x8"), "'2x8'")


def test_zero_nodes() -> None:
    expect_error(lambda: load_cluster("0x8xA100-80GB"), "0x8xA100-80GB")
    expect_error(lambda: load_cluster("2x0xA100-80GB"), "2x0xA100-80GB")


def test_malformed_yaml(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: [1\ngpus_per_node: 8\n")
    expect_error(lambda: load_cluster(str(p)), str(p), "YAML")


def test_yaml_not_a_mapping(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "- 1\n- 2\n")
    expect_error(lambda: load_cluster(str(p)), str(p))
    empty = write(tmp_path, "e.yaml", "")
    expect_error(lambda: load_cluster(str(empty)), str(empty))


def test_unknown_field(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\nnvlink: true\n")
    expect_error(lambda: load_cluster(str(p)), "nvlink", str(p))
    q = write(tmp_path, "d.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\n"
                                  "intra: {bandwidth_gbps: 10, latency_us: 1, jitter_us: 3}\n")
    expect_error(lambda: load_cluster(str(q)), "intra.jitter_us")


def test_missing_and_bad_fields(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "gpus_per_node: 8\ngpu: A100-80GB\n")
    expect_error(lambda: load_cluster(str(p)), "nodes")
    q = write(tmp_path, "d.yaml", "nodes: 0\ngpus_per_node: 8\ngpu: A100-80GB\n")
    expect_error(lambda: load_cluster(str(q)), "nodes")
    r = write(tmp_path, "e.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\n"
                                  "intra: {bandwidth_gbps: -5, latency_us: 1}\n")
    expect_error(lambda: load_cluster(str(r)), "intra.bandwidth_gbps")


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    expect_error(lambda: load_cluster(str(missing)), str(missing), "does not exist")
    expect_error(lambda: from_yaml(missing), str(missing))


def test_bad_speed_rank_out_of_range(tmp_path: Path) -> None:
    p = write(tmp_path, "c.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\nspeed: {8: 2.0}\n")
    expect_error(lambda: load_cluster(str(p)), "rank 8", "0..7")
    q = write(tmp_path, "d.yaml", "nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\nspeed: {-1: 2.0}\n")
    expect_error(lambda: load_cluster(str(q)), "rank -1")


@pytest.mark.parametrize("factor", ["0.5", "0", "-2"])
def test_bad_speed_factor_below_one(tmp_path: Path, factor: str) -> None:
    p = write(tmp_path, "c.yaml", f"nodes: 1\ngpus_per_node: 8\ngpu: A100-80GB\nspeed: {{2: {factor}}}\n")
    expect_error(lambda: load_cluster(str(p)), factor)


def test_cluster_constructor_checks_speed() -> None:
    base = dgx(1, 4, "A100-80GB")
    expect_error(lambda: Cluster("c", 1, 4, base.gpu, base.intra, base.inter, speed=(1.0, 1.0)), "2 speed", "4")
    expect_error(lambda: Cluster("c", 1, 2, base.gpu, base.intra, base.inter, speed=(1.0, 0.0)), "positive")


# ---- with_memory / with_slow -----------------------------------------------------------------------------------

def test_with_memory() -> None:
    c = load_cluster("2x8xA100-80GB")
    small = c.with_memory(40)
    assert small.gpu.memory_bytes == 40 * GIB
    assert small.gpu.peak_flops == c.gpu.peak_flops and small.gpu.name == c.gpu.name
    assert (small.nodes, small.gpus_per_node, small.intra, small.inter) == (2, 8, c.intra, c.inter)
    assert c.gpu.memory_bytes == 80 * GIB  # the original is unchanged
    assert GPUS["A100-80GB"].memory_bytes == 80 * GIB


def test_with_slow() -> None:
    c = load_cluster("1x8xH100-80GB")
    slow = c.with_slow({2: 3.0})
    assert slow.speed_of(2) == 3.0 and slow.speed_of(0) == 1.0 and len(slow.speed) == 8
    assert c.speed == ()  # original unchanged
    slower = slow.with_slow({5: 1.25})  # keeps earlier factors
    assert slower.speed_of(2) == 3.0 and slower.speed_of(5) == 1.25
    assert slow.with_slow({2: 1.0}).speed_of(2) == 1.0  # healing a device
    assert c.with_slow({}) == c.with_slow({0: 1.0})


def test_with_slow_errors() -> None:
    c = load_cluster("1x8xH100-80GB")
    expect_error(lambda: c.with_slow({8: 2.0}), "rank 8", "0..7")
    expect_error(lambda: c.with_slow({1: 0.9}), "0.9")


# ---- known problems (xfail until fixed in src) ---------------------------------------------------------------

def test_yaml_file_named_like_shorthand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("2x8xlab.yaml").write_text("nodes: 2\ngpus_per_node: 8\ngpu: A100-80GB\n")
    assert load_cluster("2x8xlab.yaml").world_size == 16


@pytest.mark.parametrize("gpu", ["{name: X, peak_tflops: -1, memory_gib: 8, hbm_gbps: 1}",
                                 "{name: X, peak_tflops: 100, memory_gib: 8, hbm_gbps: 1, tdp_w: 700}"],
                         ids=["bad-value", "unknown-field"])
def test_custom_gpu_table_error_names_the_field(tmp_path: Path, gpu: str) -> None:
    p = write(tmp_path, "c.yaml", f"nodes: 1\ngpus_per_node: 8\ngpu: {gpu}\n"
                                  "intra: {bandwidth_gbps: 1, latency_us: 1}\ninter: {bandwidth_gbps: 1, latency_us: 1}\n")
    err = expect_error(lambda: load_cluster(str(p)))
    assert "peak_tflops" in str(err) or "tdp_w" in str(err)
