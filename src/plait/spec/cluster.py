"""Cluster: devices, their speeds, and the two-level network between them.

A cluster is `nodes` x `gpus_per_node` devices of one GPU type. Inside a node devices talk over NVLink
(`intra`), between nodes over the network (`inter`); bandwidths are per GPU and per direction, the way
NCCL's "bus bandwidth" is quoted. Each node has host memory and each GPU a link to it (`host`: PCIe, or
NVLink-C2C on GH200), optionally with NVMe behind it, for swapping activations and offloading model states. Rank r lives on node r // gpus_per_node. Each device has a speed factor
(its time relative to a healthy device: 1.0 healthy, 2.0 twice as slow) for straggler planning.

Sources: `NODESxGPUSxTYPE` shorthand (e.g. `192x8xA100-80GB`), a YAML file, or a Cluster built in Python.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plait.cached_hash import cached_hash
from plait.errors import PlaitError

GIB = 1024**3
GB = 1e9
TFLOPS = 1e12


@cached_hash
@dataclass(frozen=True)
class GPU:
    """One accelerator type. FLOP/s are dense (no sparsity); bytes and bytes/s are decimal where vendors
    quote them so, memory is what the device reports."""

    name: str
    peak_flops: float  # dense 16-bit (bf16/fp16) tensor-core FLOP/s
    peak_tf32_flops: float  # dense TF32 tensor-core FLOP/s (what fp32 training gets)
    memory_bytes: float  # device memory as reported by the driver
    hbm_bandwidth: float  # bytes/s
    sm_count: int  # streaming multiprocessors (wave quantisation of GEMM tiles)


@cached_hash
@dataclass(frozen=True)
class Link:
    """A communication path as seen by one GPU: bandwidth per direction (bytes/s) and per-message
    latency (seconds)."""

    bandwidth: float
    latency: float


# Datasheet peaks: NVIDIA A100 datasheet (312 TFLOP/s bf16, 156 TF32, 1555 GB/s 40GB, 2039 GB/s 80GB SXM),
# H100 SXM datasheet (989 TFLOP/s bf16 dense, 494 TF32, 3.35 TB/s), H200 SXM (989 TFLOP/s, 4.8 TB/s).
# Memory is the driver-reported total (nvidia-smi MiB).
GPUS: dict[str, GPU] = {
    "A100-40GB": GPU("A100-40GB", 312 * TFLOPS, 156 * TFLOPS, 40960 * 2**20, 1555 * GB, 108),
    "A100-80GB": GPU("A100-80GB", 312 * TFLOPS, 156 * TFLOPS, 81920 * 2**20, 2039 * GB, 108),
    "H100-80GB": GPU("H100-80GB", 989 * TFLOPS, 494 * TFLOPS, 81559 * 2**20, 3350 * GB, 132),
    "H200-141GB": GPU("H200-141GB", 989 * TFLOPS, 494 * TFLOPS, 143771 * 2**20, 4800 * GB, 132),
    # A800: the export A100 (same SMs, clocks and HBM2e as the A100 80GB SXM), NVLink cut to 400 GB/s.
    "A800-80GB": GPU("A800-80GB", 312 * TFLOPS, 156 * TFLOPS, 81920 * 2**20, 2039 * GB, 108),
    # GH200 superchip's Hopper GPU (GH200 datasheet: 96 GB HBM3 at 4 TB/s, H100 SXM's tensor cores).
    "GH200-96GB": GPU("GH200-96GB", 989 * TFLOPS, 494 * TFLOPS, 96 * GIB, 4000 * GB, 132),
    # V100 SXM3 32GB (Tesla V100 datasheet: 125 TFLOP/s fp16 tensor, 15.7 TFLOP/s fp32 -- no TF32, so fp32
    # training runs on CUDA cores; 900 GB/s HBM2; 80 SMs; nvidia-smi reports 32510 MiB).
    "V100-32GB": GPU("V100-32GB", 125 * TFLOPS, 15.7 * TFLOPS, 32510 * 2**20, 900 * GB, 80),
}

NVLINK_LATENCY_S = 3e-6
"""Per-message latency of an NVLink/NVSwitch hop inside a node (NCCL small-message all-reduce ~ 10 us
for 8 GPUs over ~ 3 ring steps)."""
IB_LATENCY_S = 8e-6
"""Per-message latency between nodes over InfiniBand/RoCE (a few us per hop plus the NIC)."""

# DGX-style defaults per GPU type: NVLink per-direction bandwidth per GPU, and network bandwidth per GPU
# (one NIC per GPU). DGX A100: NVLink3 12 links x 25 GB/s = 300 GB/s per direction; 8x HDR 200 Gb/s
# = 25 GB/s per GPU. DGX H100/H200: NVLink4 18 links = 450 GB/s per direction; 8x NDR 400 Gb/s = 50 GB/s.
DGX_LINKS: dict[str, tuple[Link, Link]] = {
    "A100-40GB": (Link(300 * GB, NVLINK_LATENCY_S), Link(25 * GB, IB_LATENCY_S)),
    "A100-80GB": (Link(300 * GB, NVLINK_LATENCY_S), Link(25 * GB, IB_LATENCY_S)),
    "H100-80GB": (Link(450 * GB, NVLINK_LATENCY_S), Link(50 * GB, IB_LATENCY_S)),
    "H200-141GB": (Link(450 * GB, NVLINK_LATENCY_S), Link(50 * GB, IB_LATENCY_S)),
    # A800 SXM: NVLink 400 GB/s bidirectional = 200 GB/s per direction; HDR 200 Gb/s per GPU as DGX A100.
    "A800-80GB": (Link(200 * GB, NVLINK_LATENCY_S), Link(25 * GB, IB_LATENCY_S)),
    # DGX GH200: every superchip on the NVLink switch system (18 NVLink4 links, 450 GB/s per direction) and
    # one NDR 400 Gb/s NIC per superchip.
    "GH200-96GB": (Link(450 * GB, NVLINK_LATENCY_S), Link(50 * GB, IB_LATENCY_S)),
    # DGX-2 (16 V100 32GB on NVSwitch): NVLink2 6 links x 25 GB/s = 150 GB/s per direction per GPU; 8 EDR
    # 100 Gb/s NICs per 16 GPUs = 6.25 GB/s per GPU (DGX-2 datasheet).
    "V100-32GB": (Link(150 * GB, NVLINK_LATENCY_S), Link(6.25 * GB, IB_LATENCY_S)),
}

PCIE_LATENCY_S = 10e-6
"""Latency of one host<->device copy over PCIe or C2C (cudaMemcpyAsync launch and DMA setup, ~ 5-10 us)."""


@dataclass(frozen=True)
class Host:
    """A node's host side: memory per node (bytes), the link between each GPU and host memory (bytes/s
    per GPU per direction when every GPU of the node copies at once), and optional NVMe behind it (bytes per
    node, bytes/s per node; 0 when absent)."""

    memory_bytes: float
    link: Link
    nvme_bytes: float = 0.0
    nvme_bandwidth: float = 0.0


PCIE4_X16 = 25 * GB
"""Host<->device copy rate of one PCIe Gen4 x16 link (32 GB/s raw per direction; ~ 25 GB/s measured by
CUDA's bandwidthTest with pinned memory)."""
PCIE5_X16 = 50 * GB
"""Host<->device copy rate of one PCIe Gen5 x16 link (64 GB/s raw per direction; ~ 50 GB/s pinned)."""
PCIE3_X16 = 12.5 * GB
"""Host<->device copy rate of one PCIe Gen3 x16 link (16 GB/s raw per direction; ~ 12-13 GB/s pinned,
CUDA's bandwidthTest on DGX-1/DGX-2 V100)."""
C2C = 450 * GB
"""NVLink-C2C between Grace and Hopper on GH200 (900 GB/s bidirectional, GH200 datasheet)."""
NVME_GEN4_DRIVE = 6.5 * GB
"""Sequential read of one PCIe Gen4 U.2 data-centre NVMe drive (3.84 TB class, ~ 6.5-7 GB/s datasheet)."""

# Host side per GPU type, as the DGX of that GPU ships it (per node of 8 GPUs; GH200 per superchip):
# DGX A100 user guide: 1 TB DDR4, four PCIe Gen4 switches each joining two GPUs (and their NICs) to the CPU
# over one x16 uplink (so two GPUs share 25 GB/s), 15 TB of NVMe cache (4 x 3.84 TB Gen4 U.2).
# A800 servers (HGX A800 8-GPU boards): built as DGX A100. DGX H100/H200 user guide: 2 TB DDR5, PCIe Gen5
# x16 per GPU, 30 TB NVMe cache (8 x 3.84 TB). GH200 datasheet: 480 GB LPDDR5X per superchip over C2C, no
# local NVMe assumed.
DGX_HOSTS: dict[str, Host] = {
    "A100-40GB": Host(1000 * GB, Link(PCIE4_X16 / 2, PCIE_LATENCY_S), 4 * 3.84e12, 4 * NVME_GEN4_DRIVE),
    "A100-80GB": Host(1000 * GB, Link(PCIE4_X16 / 2, PCIE_LATENCY_S), 4 * 3.84e12, 4 * NVME_GEN4_DRIVE),
    "A800-80GB": Host(1000 * GB, Link(PCIE4_X16 / 2, PCIE_LATENCY_S), 4 * 3.84e12, 4 * NVME_GEN4_DRIVE),
    "H100-80GB": Host(2000 * GB, Link(PCIE5_X16, PCIE_LATENCY_S), 8 * 3.84e12, 8 * NVME_GEN4_DRIVE),
    "H200-141GB": Host(2000 * GB, Link(PCIE5_X16, PCIE_LATENCY_S), 8 * 3.84e12, 8 * NVME_GEN4_DRIVE),
    "GH200-96GB": Host(480 * GB, Link(C2C, PCIE_LATENCY_S)),
    # DGX-2 (ZeRO-Offload's machine, Ren et al. ATC'21 Sec. 6.1): 1.5 TB DDR4 per 16 GPUs, a PCIe Gen3 x16
    # link per GPU, 30 TB NVMe (8 x 3.84 TB); quoted per 8 GPUs like the others.
    "V100-32GB": Host(750 * GB, Link(PCIE3_X16, PCIE_LATENCY_S), 4 * 3.84e12, 4 * NVME_GEN4_DRIVE),
}
DGX_GPUS_PER_NODE = 8
"""GPUs of the DGX node whose host memory and NVMe DGX_HOSTS quote (GH200: 1 per superchip, scaled below)."""


@lru_cache(maxsize=256)
def default_host(gpu_type: str, gpus_per_node: int) -> Host:
    """The host side of a node of `gpus_per_node` GPUs of `gpu_type`: DGX_HOSTS scaled by GPUs per node
    (host memory and NVMe per GPU as in the DGX; link per GPU unchanged). Unknown types: the A100's."""
    base = DGX_HOSTS.get(gpu_type, DGX_HOSTS["A100-80GB"])
    per = gpus_per_node if gpu_type.startswith("GH200") else gpus_per_node / DGX_GPUS_PER_NODE
    return replace(base, memory_bytes=base.memory_bytes * per, nvme_bytes=base.nvme_bytes * per,
                   nvme_bandwidth=base.nvme_bandwidth * per)


@cached_hash
@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` devices of one type on a two-level network."""

    name: str
    nodes: int
    gpus_per_node: int
    gpu: GPU
    intra: Link
    inter: Link
    speed: tuple[float, ...] = field(default=())  # per rank, time relative to a healthy device; () = all 1.0
    host: Host | None = None  # None: default_host of the GPU type

    @property
    def host_side(self) -> Host:
        """The node's host memory, host link and NVMe (given, or the GPU type's DGX default)."""
        return self.host or default_host(self.gpu.name, self.gpus_per_node)

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise PlaitError(f"cluster {self.name!r} needs at least one node and one GPU per node")
        if self.speed and len(self.speed) != self.world_size:
            raise PlaitError(f"cluster {self.name!r}: {len(self.speed)} speed factors for "
                             f"{self.world_size} devices; give one per device")
        if any(s <= 0 for s in self.speed):
            raise PlaitError(f"cluster {self.name!r}: speed factors must be positive")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def speed_of(self, rank: int) -> float:
        """Time factor of a device (1.0 = healthy)."""
        return self.speed[rank] if self.speed else 1.0

    def with_memory(self, gib: float) -> Cluster:
        """A copy whose devices have `gib` GiB of memory."""
        return replace(self, gpu=replace(self.gpu, memory_bytes=gib * GIB))

    def with_slow(self, slow: dict[int, float]) -> Cluster:
        """A copy where the given ranks run `factor` times slower."""
        speed = list(self.speed or [1.0] * self.world_size)
        for rank, factor in slow.items():
            if not 0 <= rank < self.world_size:
                raise PlaitError(f"a slowdown is given for rank {rank}, but the cluster has ranks "
                                 f"0..{self.world_size - 1}")
            if not (math.isfinite(factor) and 1.0 <= factor <= MAX_SLOWDOWN):
                raise PlaitError(f"slowdown {factor} of rank {rank}: a slowdown factor is a number from 1.0 to "
                                 f"{MAX_SLOWDOWN:g} (time relative to a healthy device; leave a slower one out)")
            speed[rank] = factor
        return replace(self, speed=tuple(speed))


MAX_SLOWDOWN = 1e4
"""Largest slowdown factor a device may have (a slower one is as good as down)."""

SNAP_FACTOR = 1.2
"""Speed factors below this count as healthy when planning around stragglers (re-planning for a 10% wobble
costs more in migrations than it wins)."""


def snap(factors: Sequence[float], threshold: float = SNAP_FACTOR) -> list[float]:
    """Speed factors with those below `threshold` set to healthy (1.0)."""
    return [1.0 if f < threshold else f for f in factors]


def dgx(nodes: int, gpus_per_node: int, gpu_type: str) -> Cluster:
    """A DGX-style cluster of `nodes` x `gpus_per_node` GPUs of `gpu_type`."""
    if gpu_type not in GPUS:
        raise PlaitError(f"unknown GPU type {gpu_type!r}; known: {', '.join(GPUS)}")
    intra, inter = DGX_LINKS[gpu_type]
    return Cluster(f"{nodes}x{gpus_per_node}x{gpu_type}", nodes, gpus_per_node, GPUS[gpu_type], intra, inter)


def local_ranks(n: int) -> Cluster:
    """A stand-in cluster of `n` ranks on this machine, for validating plans the runtime launches here
    (only its size matters)."""
    return replace(dgx(1, n, "A100-80GB"), name=f"{n} local ranks")


class _LinkFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bandwidth_gbps: float = Field(gt=0, description="GB/s per GPU per direction")
    latency_us: float = Field(ge=0)


class _GpuFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    peak_tflops: float = Field(gt=0)
    peak_tf32_tflops: float | None = Field(default=None, gt=0)
    memory_gib: float = Field(gt=0)
    hbm_gbps: float = Field(gt=0)
    sm_count: int = Field(default=108, gt=0)


class _HostFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    memory_gib: float | None = Field(default=None, gt=0, description="host memory per node")
    link_gbps: float | None = Field(default=None, gt=0, description="GB/s per GPU per direction to host memory")
    nvme_tb: float | None = Field(default=None, ge=0, description="NVMe capacity per node, TB")
    nvme_gbps: float | None = Field(default=None, ge=0, description="NVMe bandwidth per node, GB/s")


class _ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = "cluster"
    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    gpu: str | _GpuFile
    intra: _LinkFile | None = None
    inter: _LinkFile | None = None
    speed: dict[int, float] | None = None
    host: _HostFile | None = None


def _host(spec: _HostFile | None, default: Host) -> Host | None:
    """The host side a cluster file gives (its fields over `default`), or None when it gives none."""
    if spec is None:
        return None
    return Host(default.memory_bytes if spec.memory_gib is None else spec.memory_gib * GIB,
                default.link if spec.link_gbps is None else Link(spec.link_gbps * GB, default.link.latency),
                default.nvme_bytes if spec.nvme_tb is None else spec.nvme_tb * 1e12,
                default.nvme_bandwidth if spec.nvme_gbps is None else spec.nvme_gbps * GB)


def _link(spec: _LinkFile | None, default: Link) -> Link:
    return default if spec is None else Link(spec.bandwidth_gbps * GB, spec.latency_us * 1e-6)


def from_yaml(path: Path) -> Cluster:
    """A Cluster from YAML: nodes, gpus_per_node, gpu (a type name or a table), optional intra/inter links
    (`bandwidth_gbps`, `latency_us`), per-rank `speed` factors and the `host` side (`memory_gib` per node,
    `link_gbps` per GPU, `nvme_tb` and `nvme_gbps` per node; each defaults to the GPU type's DGX value)."""
    try:
        raw = yaml.safe_load(path.read_text())
        spec = _ClusterFile.model_validate(raw)
    except OSError as exc:
        raise PlaitError(f"cannot read cluster file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PlaitError(f"cluster file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    except ValidationError as exc:
        errors = exc.errors()
        if isinstance(raw, dict) and isinstance(raw.get("gpu"), dict):  # name the gpu table's field, not str's
            errors = [e for e in errors if "str" not in e["loc"]] or errors
        err = errors[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise PlaitError(f"cluster file {str(path)!r}: {where}: {err['msg']}") from None
    if isinstance(spec.gpu, str):
        if spec.gpu not in GPUS:
            raise PlaitError(f"cluster file {str(path)!r}: unknown gpu {spec.gpu!r}; known: {', '.join(GPUS)} "
                             "(or give a table with name, peak_tflops, memory_gib, hbm_gbps)")
        gpu = GPUS[spec.gpu]
        intra_default, inter_default = DGX_LINKS[spec.gpu]
    else:
        g = spec.gpu
        gpu = GPU(g.name, g.peak_tflops * TFLOPS, (g.peak_tf32_tflops or g.peak_tflops / 2) * TFLOPS,
                  g.memory_gib * GIB, g.hbm_gbps * GB, g.sm_count)
        intra_default, inter_default = DGX_LINKS["A100-80GB"]
        if spec.intra is None or spec.inter is None:
            raise PlaitError(f"cluster file {str(path)!r}: a custom gpu needs intra and inter links "
                             "(bandwidth_gbps, latency_us)")
    cluster = Cluster(spec.name, spec.nodes, spec.gpus_per_node, gpu,
                      _link(spec.intra, intra_default), _link(spec.inter, inter_default),
                      host=_host(spec.host, default_host(gpu.name, spec.gpus_per_node)))
    return cluster.with_slow(spec.speed) if spec.speed else cluster


_SHORTHAND = re.compile(r"^(\d+)x(\d+)x(.+)$")


def load_cluster(ref: str) -> Cluster:
    """A Cluster from `NODESxGPUSxTYPE` (e.g. `2x8xH100-80GB`) or a YAML path."""
    path = Path(ref)
    if path.is_file():
        return from_yaml(path)
    m = _SHORTHAND.match(ref)
    if m:
        nodes, per_node, gpu_type = int(m.group(1)), int(m.group(2)), m.group(3)
        if gpu_type not in GPUS:
            raise PlaitError(f"unknown GPU type {gpu_type!r} in {ref!r}; known: {', '.join(GPUS)}")
        return dgx(nodes, per_node, gpu_type)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise PlaitError(f"cluster file {ref!r} does not exist; give NODESxGPUSxTYPE (e.g. 2x8xH100-80GB) "
                             "or a YAML path")
        return from_yaml(path)
    raise PlaitError(f"unknown cluster {ref!r}; use NODESxGPUSxTYPE such as 192x8xA100-80GB "
                     f"(types: {', '.join(GPUS)}) or a YAML file")
