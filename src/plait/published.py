"""Published training runs as (model, cluster, plan, reported figures), for checking the cost model.

Files follow the schema of `shared/data/published/training-runs.json`: each run gives the model shape,
the parallel layout, the GPU type and count, and the reported figures (hardware or model TFLOP/s per GPU,
MFU/HFU, iteration time, tokens/s). GPT-style rows are Megatron GPT (LayerNorm, GeLU, dropout, learned
positions) with the unfused attention of their time unless a row names its kernel (`"attention": "flash"`, or
`"triton"` for the Triton FlashAttention that llm-foundry's MPT benchmarks ran). A row whose
model gives a `"preset"` (the MoE rows) is that preset of `plait.spec.model` at the row's sequence length, and
its layout may give the expert degrees `ep` and `etp` and the plan's `expert_load`, `dispatcher` and `routing`. Offload and long-context rows
(group "offload") may give `swap` (share of saved activations swapped to host memory) and `offload` ("optim") in
their layout, and `host_memory_gb` (the node's host memory in GB, when the run used fewer GPUs than the node has).
A row may say how its MFU counts causal attention (`mfu_convention`: "whole", the default, or "causal_half").
A layout's `chunk_layers` (pp*vpp layer counts in model order) replaces the even split of layers over the
pipeline's chunks, for runs that published an uneven one (Llama 3 405B: one layer fewer on the first and last
stage). Megatron-LM rows are priced with Megatron-LM's synchronous pipeline exchanges (`Plan.p2p` "megatron")
unless their layout gives `p2p` "async" (Llama 3's "asynchronous point-to-point communication in PP"); a
layout's `p2p` "torch" names torch.distributed.pipelining's synchronous exchanges (NeMo AutoModel's rows).
A ZeRO-3 row's layout may name its FSDP runtime, `fsdp_runtime` "torch" (PyTorch FSDP, the default) or "megatron"
(Megatron-FSDP, priced with `plait.cost.calibration.megatron_fsdp`). A row whose model TFLOP/s or MFU was printed
by Megatron-LM from MR !2789 (2025-03-06, megatron/training/training.py num_floating_point_operations: "Only half
of the attention matrix is non-zero") gives `"mfu_convention": "causal_half"`: its figure is compared with plait's
counted with causal attention cores at half (`causal_mfu`); plait's own count takes them whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import get_args

from plait.cost.calibration import Calibration, calibration_for, megatron_fsdp
from plait.cost.precision import PRECISIONS
from plait.errors import PlaitError
from plait.plan import P2p, Plan, recut_chunks, uniform_plan
from plait.simulate import Report, simulate
from plait.spec.cluster import GB, Cluster, Link, dgx
from plait.spec.model import PRESETS, ModelSpec

MFU_CONVENTIONS = ("whole", "causal_half")
"""A row's `mfu_convention`: its MFU counts the attention cores whole (Megatron's formula, plait's MFU; the
default) or those of causal layers at half (`causal_mfu`); the row's MFU is compared in its convention."""
FSDP_RUNTIMES = ("torch", "megatron")  # a row's `fsdp_runtime`: PyTorch FSDP or Megatron-FSDP
REPORTED_KEYS = ("hardware_tflops_per_gpu", "model_tflops_per_gpu", "iteration_time_s", "mfu", "hfu",
                 "tokens_per_s")


@dataclass(frozen=True)
class PublishedRun:
    """One published run, ready to simulate."""

    source: str
    model: ModelSpec
    cluster: Cluster
    plan: Plan
    strategy: str  # the --strategy text of the layout
    reported: dict[str, float]
    fully_published: bool
    group: str = "megatron"  # software family: "megatron", "deepspeed" (MT-NLG's pipeline engine), "fsdp", or
    # "moe" (mixture-of-experts runs with expert parallelism, whatever their software)
    held_out: bool = False  # set aside before any constant was chosen; graded separately
    cal: Calibration | None = None  # the runtime's calibration where it is not the GPU type's default
    mfu_convention: str = "whole"  # how the row's MFU counts causal attention (MFU_CONVENTIONS)

    def report(self) -> Report:
        """The run's layout simulated with its calibration."""
        return simulate(self.plan, self.model, self.cluster, self.cal)


def _model(row: dict) -> ModelSpec:
    md = row["model"]
    if "preset" in md:  # an MoE (or other) preset of plait.spec.model, trained at the row's sequence length
        return PRESETS[md["preset"]].with_(max_seq_len=max(md["seq_len"], PRESETS[md["preset"]].max_seq_len))
    common = {"name": f"{md['layers']}L-h{md['hidden']}", "layers": md["layers"], "hidden": md["hidden"],
              "heads": md["heads"], "vocab": md["vocab"], "max_seq_len": md["seq_len"]}
    if md.get("family", "gpt") == "llama":
        return ModelSpec(family="llama", kv_heads=md.get("kv_heads", md["heads"]), ffn=md["ffn"], gated_mlp=True,
                         norm="rmsnorm", bias=False, dropout=False, tied_embeddings=False, learned_positions=False,
                         attention=md.get("attention", "flash"), **common)
    flags = {k: md[k] for k in ("bias", "dropout", "learned_positions") if k in md}  # MPT: no biases, no dropout
    return ModelSpec(family="gpt", attention=md.get("attention", "eager"), **flags, **common)


def _strategy(layout: dict) -> str:
    keys = {
        "tp": layout["tp"], "pp": layout["pp"], "dp": layout["dp"], "cp": layout.get("cp", 1),
        "mbs": layout["micro_batch"], "gbs": layout["global_batch"], "recompute": layout["recompute"],
        "sp": int(bool(layout.get("sequence_parallel", False))), "vpp": layout.get("vpp", 1),
        "zero": layout.get("zero", 0), "precision": layout.get("precision", "bf16"),
        "cp_mode": layout.get("cp_mode", "ulysses"), "shard": layout.get("shard", 0),
        "grad_reduce": layout.get("reduce_dtype", "auto"),
    }
    # MoE rows: expert degrees, busiest expert rank's load, token dispatcher, routing; offload rows: swap,
    # offload; schedule_runs: pipeline schedules a step (NeMo AutoModel: one per accumulation step); ep_overlap:
    # Megatron's expert-parallel overlap; recompute_modules: Megatron's module-wise recompute (mla_up_proj+mlp).
    layout_keys = ("ep", "etp", "expert_load", "dispatcher", "routing", "swap", "offload", "schedule_runs",
                   "ep_overlap", "recompute_modules")
    keys.update({k: layout[k] for k in layout_keys if k in layout})
    if "overlap_grad_reduce" in layout:  # Megatron's overlap_grad_reduce (the default: on)
        keys["overlap"] = int(bool(layout["overlap_grad_reduce"]))
    return ",".join(f"{k}={v}" for k, v in keys.items())


def load_runs(path: str | Path) -> tuple[list[PublishedRun], list[tuple[str, str]]]:
    """Runs of a published-runs file, and (source, reason) for rows that cannot be simulated."""
    rows = json.loads(Path(path).read_text())["runs"]
    runs: list[PublishedRun] = []
    skipped: list[tuple[str, str]] = []
    for row in rows:
        precision = row["layout"].get("precision", "bf16")
        if precision not in PRECISIONS:
            skipped.append((row["source"], f"precision {precision} is not modelled"))
            continue
        gpus = row["gpus"]
        per_node = min(8, gpus)
        cluster = _cluster(row, gpus // per_node, per_node)
        model = _model(row)
        strategy = _strategy(row["layout"])
        try:
            plan = uniform_plan(strategy, model, cluster, row["model"]["seq_len"])
            if "chunk_layers" in row["layout"]:
                plan = recut_chunks(plan, row["layout"]["chunk_layers"], model, cluster)
            plan = plan.model_copy(update={"p2p": _p2p(row)})
        except PlaitError as exc:
            skipped.append((row["source"], str(exc)))
            continue
        runtime = row["layout"].get("fsdp_runtime", "torch")
        if runtime not in FSDP_RUNTIMES:
            skipped.append((row["source"], f"fsdp_runtime {runtime!r} is not one of {', '.join(FSDP_RUNTIMES)}"))
            continue
        convention = row.get("mfu_convention", "whole")
        if convention not in MFU_CONVENTIONS:
            skipped.append((row["source"],
                            f"mfu_convention {convention!r} is not one of {', '.join(MFU_CONVENTIONS)}"))
            continue
        reported = {k: float(v) for k, v in row["reported"].items() if k in REPORTED_KEYS}
        cal = megatron_fsdp(calibration_for(cluster.gpu.name), cluster.gpu) if runtime == "megatron" else None
        runs.append(PublishedRun(row["source"], model, cluster, plan, strategy, reported,
                                 bool(row.get("layout_fully_published", True)), _group(row),
                                 bool(row.get("held_out", False)), cal, convention))
    return runs, skipped


def _cluster(row: dict, nodes: int, per_node: int) -> Cluster:
    """A DGX-style cluster of the row's GPUs; a row's `network_gbps_per_node` (Gb/s out of each node, e.g. AWS
    EFA's 400) replaces the DGX network, shared evenly by the node's GPUs."""
    cluster = dgx(nodes, per_node, row["gpu"])
    if "network_gbps_per_node" in row:
        per_gpu = row["network_gbps_per_node"] * 1e9 / 8 / per_node
        cluster = replace(cluster, inter=Link(per_gpu, cluster.inter.latency))
    if "host_memory_gb" in row:  # e.g. one GPU of a DGX-2 with the whole node's 1.5 TB
        cluster = replace(cluster, host=replace(cluster.host_side, memory_bytes=row["host_memory_gb"] * GB))
    return cluster


def _p2p(row: dict) -> str:
    """How the row's pipeline stages exchanged activations (Plan.p2p): its layout's "p2p", else Megatron-LM's
    synchronous exchanges for Megatron-LM rows (overlap_p2p_comm off, the default of the versions these rows ran),
    else asynchronous."""
    p2p = row["layout"].get("p2p") or ("megatron" if _group(row) == "megatron" else "async")
    if p2p not in get_args(P2p):
        raise PlaitError(f"layout p2p {p2p!r} must be one of {', '.join(get_args(P2p))}; fix the row")
    return p2p


def _group(row: dict) -> str:
    """The software family of a row: its "group" field, else DeepSpeed for MT-NLG's rows, else Megatron-LM."""
    return row.get("group") or ("deepspeed" if "DeepSpeed" in row["source"] else "megatron")


MODEL_FLOPS_KEYS = ("model_tflops_per_gpu", "mfu")  # figures that count model FLOPs


def predicted(report: Report, key: str, run: PublishedRun | None = None) -> float:
    """The report's value of a reported key, its model FLOPs counted as `run` counts them (its
    `mfu_convention`)."""
    value = float(getattr(report, key))
    if run is not None and run.mfu_convention == "causal_half" and key in MODEL_FLOPS_KEYS and report.mfu > 0:
        value *= causal_mfu(report, run.model, run.plan.seq_len) / report.mfu
    return value


def relative_errors(run: PublishedRun, report: Report) -> dict[str, tuple[float, float, float]]:
    """{key: (published, predicted, relative error)} for every figure the run reports (its model FLOPs in
    its `mfu_convention`)."""
    values = {k: predicted(report, k, run) for k in run.reported}
    return {k: (v, values[k], values[k] / v - 1) for k, v in run.reported.items()}


def executed_fraction(model: ModelSpec, seq_len: int) -> float:
    """Share of the model's FLOPs per token counted whole (Megatron's 72*l*h^2*(1 + s/(6h) + V/(12lh)),
    plait's MFU) that a causal fused-attention kernel executes: the attention cores of causal layers at half
    their s x s FLOPs, everything else whole (no recomputation counted)."""
    full = model.model_flops_per_token(seq_len)
    masked = sum(b.attention_flops_per_token(seq_len) * b.seq(seq_len) * n
                 for b, n in model.block_counts if b.causal) / seq_len
    return (full - 3 * masked / 2) / full


def causal_mfu(report: Report, model: ModelSpec, seq_len: int) -> float:
    """The report's MFU with the attention cores of causal layers counted at half their s x s FLOPs (the
    convention of FlashAttention's benchmarks and of papers that count only unmasked scores), where plait's
    MFU counts them whole (Megatron's 72*l*h^2*(1 + s/(6h) + V/(12lh)))."""
    return report.mfu * executed_fraction(model, seq_len)
