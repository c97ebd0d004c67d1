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


# ---- plans and the shorthand -----------------------------------------------------------------------

def test_shorthand_and_version_4_files(tmp_path: Path) -> None:
    import json

    from plait.plan import PLAN_VERSION, load_plan, uniform_plan
    from plait.spec.model import PRESETS

    model, cluster = PRESETS["llama2-7b"], load_cluster("1x8xA800-80GB")
    plan = uniform_plan("tp=8,zero=1,swap=0.5,offload=optim", model, cluster, 4096)
    s = plan.pipelines[0].stages[0].strategies[0]
    assert (s.swap, s.offload) == (0.5, "optim") and s.short().endswith("swap=0.5 offload=optim")
    for bad, why in (("swap=1.5", "swap must be a share"), ("swap=x", "swap must be a share"),
                     ("offload=disk", "offload must be none or optim")):
        with pytest.raises(PlaitError, match=why):
            uniform_plan(f"tp=8,{bad}", model, cluster, 4096)
    raw = json.loads(uniform_plan("tp=8", model, cluster, 4096).to_json())
    raw["version"] = 4
    for stage in raw["pipelines"][0]["stages"]:
        for st in stage["strategies"]:
            del st["swap"], st["offload"]
    path = tmp_path / "v4.json"
    path.write_text(json.dumps(raw))
    read = load_plan(path)
    assert read.version == PLAN_VERSION == 5
    assert (read.pipelines[0].stages[0].strategies[0].swap, read.pipelines[0].stages[0].strategies[0].offload) \
        == (0.0, "none")
