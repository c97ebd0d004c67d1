"""The search space: every per-layer strategy a stage of n devices can use.

A strategy splits the stage's n devices into dp x tp x cp (Megatron rank order) and picks sequence
parallelism, a ZeRO stage and a recompute mode (when the limits allow, a layer that recomputes nothing may
also drop Megatron-LM's recompute modules: those that run elementwise work again, or every one it has); an
MoE layer also lays its experts out over the same devices (expert parallel ep x expert tensor parallel etp,
the rest expert data parallel). Only what the plan validator accepts is generated: tp divides the heads and
kv heads and stays inside a node, Ulysses cp divides the heads per tp rank, the micro-batch splits evenly over
dp, sequence parallelism needs tp > 1, ZeRO needs more than one replica.
Below device memory (when the limits allow it): a share of the saved activations swapped to host, and the
optimizer, or the optimizer and the parameter shard, offloaded to the host CPU (where ZeRO shards them, or on
a single replica).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from plait.cost.recompute_modules import ELEMENTWISE_MODULES, changed_by
from plait.plan import Strategy, strategy_problem
from plait.spec.cluster import Cluster
from plait.spec.layers import RECOMPUTE_MODES, Block
from plait.spec.model import ModelSpec

ATTENTION_RECOMPUTE = ("selective", "attn_kept")
"""Recompute modes defined by the attention core (layers without one: none or full only)."""
SEARCHED_RECOMPUTE = tuple(rc for rc in RECOMPUTE_MODES if rc != "gemm_kept")
"""Recompute modes the search tries by default: gemm_kept runs and is priced, but is left out until the search
baselines are recorded with it (pass it in `SpaceLimits.recompute` to search it)."""
SWAP_SHARES = (0.0, 0.5, 1.0)
"""Shares of saved activations the search may swap to host with the memory hierarchy on (none, half the
tokens, all of them: three points keep the space small; MEMO's per-layer share is continuous)."""


@dataclass(frozen=True)
class SpaceLimits:
    """Which dimensions the search may use (all by default)."""

    max_tp: int | None = None  # None: the devices of one node
    max_cp: int | None = None  # None: as many as the stage has
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: tuple[str, ...] = SEARCHED_RECOMPUTE
    recompute_modules: bool = False  # layers that recompute nothing may drop modules' (module_sets; opt in: the
    # search takes ~30% longer)
    sequence_parallel: tuple[bool, ...] = (False, True)
    context_parallel: bool = True
    max_ep: int | None = None  # None: as many as the experts and the stage allow
    expert_tp: tuple[str, ...] = ("tp", "1")  # an MoE layer's expert tensor parallelism: as tp, or none
    moe_comm: tuple[str, ...] = ("alltoall",)  # add "lsh" to let MoE layers with ep > 1 send LSH-MoE centroids
    # (opt in: it approximates the experts' outputs, so it changes the model's numerics)
    swap: tuple[float, ...] = (0.0,)  # shares of saved activations swapped to host (HIERARCHY: SWAP_SHARES)
    offload: tuple[str, ...] = ("none",)  # offload choices ("none", "optim", "params")
    interleaved: bool = True  # whether pipelines may hold several model chunks per device (virtual stages)
    allow: Callable[[Strategy], bool] | None = None  # only layer strategies it accepts (None: all valid ones)


HIERARCHY = {"swap": SWAP_SHARES, "offload": ("none", "optim", "params", "nvme")}
"""SpaceLimits fields that let the search use the memory below the device, `replace(limits, **HIERARCHY)`: the
node's host memory and, on nodes that have it, its NVMe (ZeRO-Infinity: the states and the shard in files)."""


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def block_strategies(block: Block, cluster: Cluster, devices: int, micro_batch: int, seq_len: int,
                     limits: SpaceLimits = SpaceLimits()) -> list[Strategy]:
    """All valid strategies for `block` on a stage of `devices` devices whose micro-batches hold
    `micro_batch` sequences (layers without attention have no selective or attn_kept recompute)."""
    return list(_block_strategies(block, cluster, devices, micro_batch, seq_len, limits))


@lru_cache(maxsize=1024)
def _block_strategies(block: Block, cluster: Cluster, devices: int, micro_batch: int, seq_len: int,
                      limits: SpaceLimits) -> tuple[Strategy, ...]:
    """`block_strategies`, once per stage (a search asks again for each schedule of a configuration)."""
    max_tp = min(limits.max_tp or cluster.gpus_per_node, devices)
    modes = [rc for rc in limits.recompute if block.has_attention or rc not in ATTENTION_RECOMPUTE]
    out: list[Strategy] = []
    for tp in divisors(devices):
        if tp > max_tp:
            continue
        for cp in divisors(devices // tp):
            if cp > 1 and (not limits.context_parallel or (limits.max_cp and cp > limits.max_cp)):
                continue
            dp = devices // (tp * cp)
            for sp in limits.sequence_parallel:
                if sp and tp == 1:
                    continue
                if strategy_problem(Strategy(dp=dp, tp=tp, cp=cp, sp=sp), block, devices, micro_batch, seq_len):
                    continue
                zeros = limits.zero_stages if dp * cp > 1 else (0,)
                for ep, etp, comm in expert_layouts(block, devices, tp, limits):
                    for zero in zeros:
                        for rc in modes:
                            s = Strategy(dp=dp, tp=tp, cp=cp, sp=sp, zero=zero, recompute=rc, ep=ep, etp=etp,  # type: ignore[arg-type]
                                         moe_comm=comm)  # type: ignore[arg-type]
                            if ep == 1 and etp == 0 or not strategy_problem(s, block, devices, micro_batch, seq_len):
                                for modules in module_sets(block, rc, limits):
                                    out += below_device(s.model_copy(update={"recompute_modules": modules})
                                                        if modules else s, limits, cluster)
    return tuple(s for s in out if limits.allow(s)) if limits.allow else tuple(out)


def module_sets(block: Block, recompute: str, limits: SpaceLimits = SpaceLimits()) -> list[tuple[str, ...]]:
    """Recompute-module sets the search tries on `block` under `recompute`: none; where the limits allow and the
    layer recomputes nothing, the modules it has that run elementwise work again (the norms, the experts'
    activation), then all it has (adding the GEMMs of latent attention's up-projections or of a dense MLP),
    each set once. (Selective recompute with modules is priced and runs, but is not searched.)"""
    sets: list[tuple[str, ...]] = [()]
    if limits.recompute_modules and recompute == "none":
        changed = changed_by(block)
        for modules in (tuple(m for m in changed if m in ELEMENTWISE_MODULES), changed):
            if modules and modules not in sets:
                sets.append(modules)
    return sets


def below_device(s: Strategy, limits: SpaceLimits, cluster: Cluster) -> list[Strategy]:
    """`s` with each swap share and offload choice the limits allow; offload only where each device steps
    its own shard (ZeRO over the replicas, or one replica), not a copy every replica repeats, and to NVMe
    only on nodes that have it."""
    nvme = cluster.host_side.nvme_bytes > 0
    offloads = [o for o in limits.offload if (o == "none" or s.zero >= 1 or s.dp * s.cp == 1)
                and (o != "nvme" or nvme)]
    return [s.model_copy(update={"swap": a, "offload": o}) if (a, o) != (0.0, "none") else s
            for o in offloads for a in limits.swap]


def expert_layouts(block: Block, devices: int, tp: int,
                   limits: SpaceLimits = SpaceLimits()) -> list[tuple[int, int, str]]:
    """(ep, etp, moe_comm) for an MoE layer on `devices` ranks with attention tensor parallel `tp` (etp 0: as
    tp; LSH-MoE only where ep > 1, where there is an all-to-all to compress); (1, 0, "alltoall") for other
    layers, which have no experts to lay out."""
    if block.kind != "moe":
        return [(1, 0, "alltoall")]
    out = []
    for etp in dict.fromkeys(0 if e == "tp" else int(e) for e in limits.expert_tp):
        width = etp or tp
        if devices % width or block.expert_ffn % width:
            continue
        for ep in divisors(devices // width):
            if block.experts % ep == 0 and ep <= (limits.max_ep or ep) and (etp == 0 or etp != tp):
                out += [(ep, etp, comm) for comm in limits.moe_comm if comm == "alltoall" or ep > 1]
    return out


def stage_strategies(model: ModelSpec, cluster: Cluster, devices: int, micro_batch: int, seq_len: int,
                     limits: SpaceLimits = SpaceLimits()) -> list[Strategy]:
    """The strategies valid for every layer of `model` (what one strategy for the whole model may use)."""
    blocks = model.distinct_blocks
    first = block_strategies(blocks[0], cluster, devices, micro_batch, seq_len, limits)
    rest = [set(block_strategies(b, cluster, devices, micro_batch, seq_len, limits)) for b in blocks[1:]]
    return [s for s in first if all(s in r for r in rest)]


def pareto_front(costs: list[tuple[float, float]]) -> list[int]:
    """Indices of the (time, memory) pairs not dominated by another (ties keep the first)."""
    order = sorted(range(len(costs)), key=lambda i: (costs[i][0], costs[i][1], i))
    keep: list[int] = []
    best_memory = float("inf")
    for i in order:
        if costs[i][1] < best_memory:
            keep.append(i)
            best_memory = costs[i][1]
    return sorted(keep)
