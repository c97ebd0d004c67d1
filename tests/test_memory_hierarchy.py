"""The memory hierarchy below the GPU: host memory, host links and NVMe (cluster), activation swapping and
optimizer offload (cost model, plans, search, runtime)."""

from __future__ import annotations

from pathlib import Path

import pytest

from plait.errors import PlaitError
from plait.spec.cluster import GB, GIB, DGX_HOSTS, GPUS, load_cluster


# ---- cluster ---------------------------------------------------------------------------------------

def test_dgx_host_defaults() -> None:
    a800 = load_cluster("1x8xA800-80GB")
    assert a800.gpu.peak_flops == GPUS["A100-80GB"].peak_flops
    assert a800.intra.bandwidth == 200 * GB  # NVLink 400 GB/s bidirectional
    host = a800.host_side
    assert host.memory_bytes == 1000 * GB and host.link.bandwidth == 12.5 * GB  # two GPUs per Gen4 uplink
    h100 = load_cluster("2x8xH100-80GB").host_side
    assert h100.memory_bytes == 2000 * GB and h100.link.bandwidth == 50 * GB and h100.nvme_bytes > 0
    gh = load_cluster("4x4xGH200-96GB").host_side  # four superchips per node
    assert gh.memory_bytes == 4 * 480 * GB and gh.link.bandwidth == 450 * GB and gh.nvme_bytes == 0
    half = load_cluster("1x4xH100-80GB").host_side  # half a DGX: half its host memory, the same link
    assert half.memory_bytes == 1000 * GB and half.link.bandwidth == 50 * GB
    assert set(DGX_HOSTS) == set(GPUS)


def test_yaml_host_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("nodes: 2\ngpus_per_node: 8\ngpu: A800-80GB\nhost:\n  memory_gib: 512\n  link_gbps: 20\n")
    host = load_cluster(str(path)).host_side
    assert host.memory_bytes == 512 * GIB and host.link.bandwidth == 20 * GB
    assert host.nvme_bytes == DGX_HOSTS["A800-80GB"].nvme_bytes  # not given: the DGX default
    path.write_text("nodes: 1\ngpus_per_node: 8\ngpu: A800-80GB\n")
    assert load_cluster(str(path)).host is None and load_cluster(str(path)).host_side.memory_bytes == 1000 * GB
    path.write_text("nodes: 1\ngpus_per_node: 8\ngpu: A800-80GB\nhost:\n  memory_gib: -1\n")
    with pytest.raises(PlaitError, match="host.memory_gib"):
        load_cluster(str(path))
