"""Plan: how every layer of a model is parallelised, cut into pipeline stages and scheduled.

The plan is the contract between planners and the runtime. It is general enough for per-layer
(Galvatron) plans, non-uniform pipelines (Malleus) and hand-written Megatron layouts:

* A Plan holds one or more Pipelines. Pipelines are data-parallel replicas of the whole model; they may
  differ in stage cuts, devices and micro-batch counts. Layer l's gradients are reduced over every device
  that holds layer l, across and within pipelines.
* A Pipeline holds Stages (model chunks) in model order. With `chunks` > 1 (interleaved 1F1B, Megatron's
  virtual pipeline) chunk j runs on the devices of chunk j % pp, where pp = len(stages) // chunks.
* A Stage lists its layers [start, end), its ranks explicitly, and one Strategy per layer (or a single one
  for all of them). Ranks are laid out tp-fastest: list index i has tensor coordinate i % tp, context
  coordinate (i // tp) % cp and data coordinate i // (tp * cp), Megatron's order.
* Layers are the transformer blocks 0..L-1; the embedding runs with the first stage's first layer's
  strategy and the head with the last stage's last layer's strategy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from plait.cached_hash import cached_hash
from plait.errors import PlaitError
from plait.io import write_atomically
from plait.spec.cluster import Cluster
from plait.spec.degrees import Degrees
from plait.spec.layers import RECOMPUTE_MODES, Block
from plait.spec.model import ModelSpec, Recompute

Schedule = Literal["gpipe", "1f1b", "interleaved"]
Precision = Literal["bf16", "fp16", "fp32", "bf16-pure"]
GradReduce = Literal["auto", "fp32", "bf16"]
MoeComm = Literal["alltoall", "lsh"]
P2p = Literal["async", "megatron", "torch"]
SYNC_P2P: tuple[str, ...] = ("megatron", "torch")
"""Plan.p2p values whose pipeline exchanges are synchronous. "torch": torch.distributed.pipelining's, whose
schedules post each op's sends with the receives of the same step in one batch_isend_irecv and wait on it
before computing on (torch v2.9.0 torch/distributed/pipelining/schedules.py: ScheduleInterleaved1F1B is a
PipelineScheduleMulti, line 2304, whose _step_microbatches ends every time step with
``_wait_batch_p2p(_batch_p2p(ops))``, line 1730; v2.8.0 the same, lines 2090 and 1542; Schedule1F1B's steady
state in every release read, 2.8.0 to 2.13.0: ``_wait_batch_p2p(_batch_p2p(fwd_sends + bwd_recvs))``, v2.9.0
line 892). The same NCCL batched p2p and wait as Megatron-LM's, so the same hold. From torch 2.10
ScheduleInterleaved1F1B is a _PipelineScheduleRuntime, whose sends are waited only at the end of the step
(asynchronous), and ScheduleGPipe's sends always were."""
Dispatcher = Literal["alltoall", "deepep"]
Routing = Literal["random", "contiguous"]
Offload = Literal["none", "optim", "params", "nvme"]
RecomputeModule = Literal["mla_up_proj", "mlp", "moe_act", "layernorm"]
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
"""Megatron-LM's named recompute modules plait prices (`plait.cost.recompute_modules`); its `core_attn` is
plait's recompute=selective."""
KEEPS_ACTIVATIONS: tuple[str, ...] = ("none", "selective")
"""Recompute modes under which a layer keeps its activations, so that recompute modules can drop some (the
others recompute the modules' parts already)."""
PLAN_VERSION = 10
"""Version of the plan file. 10: `recompute_modules` belong to each strategy (version 9 gave them once for the
plan: they are read onto every strategy whose recompute is none or selective). 9: the plan's
`recompute_modules` (absent in older files: none). 8: the plan's
`ep_overlap` (absent in older files: False). 7: the plan's
`schedule_runs` (absent: 1). 6: the plan's `p2p`, how stages exchange activations (absent in older files:
"async", plait's runtime) and the MoE token `dispatcher` and `routing` (absent: "alltoall", "random").
5: strategies carry the share of saved activations swapped to host `swap`, the
`offload` of optimizer states to the host CPU and the MoE token exchange `moe_comm` (absent in older files: 0,
"none" and "alltoall", every routed token travels; "lsh": LSH-MoE centroids). 4: strategies carry ZeRO's
shard group `shard` (HSDP; absent in older files: 0, all data-parallel ranks) and the plan the gradient
reduce precision `grad_reduce` (absent: "auto"). 3: `model_fingerprint` (optional) records the model's
architecture; strategies carry the expert degrees `ep` and `etp` of MoE layers and the plan their
`expert_load` (absent in older files: ep 1, etp as tp, load 1). 2: a
pipeline's micro-batch is `micro_batch_sequences` (version 1 called it `micro_batch_size`, which the
--strategy shorthand's `mbs`, sequences per data-parallel replica, did not mean)."""
MAX_MICRO_BATCH_STAGES = 2**20
"""Most micro-batches x stages of one pipeline that plait prices or runs (the simulator keeps every
micro-batch's ops: about 1 KB each)."""


def _modules_onto_strategies(raw: dict) -> dict:
    """A version-9 plan file's plan-wide `recompute_modules` on each of its strategies whose recompute is none
    or selective (where Megatron-LM applies them, as version 9 priced them)."""
    modules = raw["recompute_modules"]

    def onto(s: object) -> object:
        if not isinstance(s, dict) or s.get("recompute", "none") not in KEEPS_ACTIVATIONS:
            return s
        return {**s, "recompute_modules": modules}

    def stage(st: object) -> object:
        return {**st, "strategies": [onto(s) for s in st.get("strategies", [])]} if isinstance(st, dict) else st

    def pipeline(p: object) -> object:
        return {**p, "stages": [stage(st) for st in p.get("stages", [])]} if isinstance(p, dict) else p

    rest = {k: v for k, v in raw.items() if k != "recompute_modules"}
    return {**rest, "pipelines": [pipeline(p) for p in raw.get("pipelines", [])]}


@lru_cache(maxsize=8192)
def _kept(s: Strategy) -> Strategy:
    """`s` recomputing nothing (`Strategy.without_recompute`)."""
    return s.model_copy(update={"recompute": "none", "recompute_modules": ()})


@lru_cache(maxsize=1024)
def _degrees(dp: int, tp: int, cp: int, ep: int, etp: int, shard: int = 0) -> Degrees:
    return Degrees(dp=dp, tp=tp, cp=cp, ep=ep, etp=etp, shard=shard)


@cached_hash
class Strategy(BaseModel):
    """How one layer is parallelised over its stage's devices (dp * tp * cp = devices of the stage)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp: int = Field(1, ge=1, description="data-parallel degree inside the stage")
    tp: int = Field(1, ge=1, description="tensor-parallel degree (Megatron column/row split)")
    sp: bool = Field(False, description="Megatron sequence parallelism over the tp group")
    cp: int = Field(1, ge=1, description="context-parallel degree (sequence split across devices)")
    cp_mode: Literal["ulysses", "ring"] = Field("ulysses", description="all-to-all heads or ring K/V")
    zero: int = Field(0, ge=0, le=3, description="ZeRO stage over the dp group: 0 none, 1 optimizer, "
                                                  "2 +gradients, 3 +parameters (FSDP)")
    recompute: Recompute = "none"
    ep: int = Field(1, ge=1, description="expert-parallel degree of an MoE layer's experts (other layers: 1)")
    etp: int = Field(0, ge=0, description="expert tensor-parallel degree of an MoE layer's experts (0: tp, "
                                          "as Megatron's default)")

    moe_comm: MoeComm = Field("alltoall", description="how an MoE layer's routed tokens reach its experts: "
                               "alltoall (every token) or lsh (LSH-MoE: centroids of hashed token buckets)")
    recompute_modules: tuple[RecomputeModule, ...] = Field((), description="Megatron-LM's module-wise selective "
                                                           "recompute (--recompute-modules), for recompute none or "
                                                           "selective: the named parts of the layer drop what they "
                                                           "keep for backward and run again there (modules the "
                                                           "layer lacks change nothing; "
                                                           "plait.cost.recompute_modules, plait.models.dropped)")
    shard: int = Field(0, ge=0, description="ranks ZeRO shards over: 0 all dp*cp ranks holding the weights, else "
                                            "a shard group of that size replicated over the rest (HSDP)")
    swap: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False,
                        description="share of the layer's saved activations swapped to host memory token-wise "
                                    "after its forward and fetched back for its backward (MEMO)")
    offload: Offload = Field("none", description="optim: fp32 master weights, optimizer states and gradients "
                                                 "live in host memory and the optimizer steps on the CPU "
                                                 "(ZeRO-Offload); params: the 16-bit parameter shard lives "
                                                 "there too and is paged in per layer for its forward and "
                                                 "backward (ZeRO-Infinity, FSDP2's CPUOffloadPolicy); nvme: "
                                                 "as params, the states on the node's NVMe")

    @field_validator("recompute_modules")
    @classmethod
    def _module_order(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        """Each module once, in RECOMPUTE_MODULES' order (one strategy, one spelling)."""
        if len(set(names)) != len(names):
            raise ValueError(f"recompute_modules names a module twice ({'+'.join(names)}); give each once")
        return tuple(sorted(names, key=RECOMPUTE_MODULES.index))

    @model_validator(mode="after")
    def _modules_kept(self) -> Strategy:
        if self.recompute_modules and self.recompute not in KEEPS_ACTIVATIONS:
            raise ValueError(f"recompute_modules need recompute none or selective; recompute={self.recompute} "
                             "runs those modules again already (drop recompute_modules)")
        return self

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel degree in effect (etp, or tp when etp is 0)."""
        return self.etp or self.tp

    @property
    def degrees(self) -> Degrees:
        """The layer's degrees over its stage (the one object that gives coordinates and groups)."""
        return _degrees(self.dp, self.tp, self.cp, self.ep, self.expert_tp, self.shard)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.cp

    def without_recompute(self) -> Strategy:
        """This strategy recomputing nothing (the same layout and states): itself when it recomputes nothing,
        else one shared copy per strategy (a cache key of the states it prices)."""
        return self if self.recompute == "none" and not self.recompute_modules else _kept(self)

    @property
    def ring(self) -> bool:
        """Whether the layer's context parallelism runs ring attention (cp > 1, cp_mode ring)."""
        return self.cp > 1 and self.cp_mode == "ring"

    def short(self) -> str:
        """Compact text such as `dp4 tp2 sp zero1 rc=full`."""
        parts = [f"dp{self.dp}", f"tp{self.tp}"]
        if self.sp:
            parts.append("sp")
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("-ring" if self.cp_mode == "ring" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.expert_tp != self.tp:
            parts.append(f"etp{self.expert_tp}")
        if self.moe_comm != "alltoall":
            parts.append(self.moe_comm)
        if self.zero:
            parts.append(f"zero{self.zero}")
        if self.shard:
            parts.append(f"shard{self.shard}")
        if self.recompute != "none":
            parts.append(f"rc={self.recompute}")
        if self.recompute_modules:
            parts.append(f"rcm={'+'.join(self.recompute_modules)}")
        if self.swap:
            parts.append(f"swap={self.swap:g}")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return " ".join(parts)


def stage_strategies(per_layer: Sequence[Strategy]) -> tuple[Strategy, ...]:
    """A stage's `strategies` from one strategy per layer: one for all when every layer has the same."""
    strategies = tuple(per_layer)
    return strategies[:1] if len(set(strategies)) == 1 else strategies


class Stage(BaseModel):
    """A contiguous range of layers [start, end) on an explicit list of ranks."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, int]
    ranks: tuple[int, ...]
    strategies: tuple[Strategy, ...] = Field(min_length=1, description="one per layer, or one for all")

    @model_validator(mode="after")
    def _shape(self) -> Stage:
        start, end = self.layers
        if not 0 <= start < end:
            raise ValueError(f"stage layers {list(self.layers)} must be [start, end) with 0 <= start < end")
        if len(self.strategies) not in (1, end - start):
            raise ValueError(f"stage with layers {list(self.layers)} has {len(self.strategies)} strategies; "
                             f"give 1 or {end - start}")
        if len(set(self.ranks)) != len(self.ranks) or not self.ranks:
            raise ValueError(f"stage ranks {list(self.ranks)} must be a non-empty list without repeats")
        return self

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    def strategy(self, layer: int) -> Strategy:
        """Strategy of a model layer inside this stage."""
        if len(self.strategies) == 1:
            return self.strategies[0]
        return self.strategies[layer - self.layers[0]]

    def layer_strategies(self) -> list[tuple[Strategy, int]]:
        """Runs of identical consecutive strategies: (strategy, number of layers)."""
        if len(self.strategies) == 1:
            return [(self.strategies[0], self.num_layers)]
        runs: list[tuple[Strategy, int]] = []
        for s in self.strategies:
            if runs and runs[-1][0] == s:
                runs[-1] = (s, runs[-1][1] + 1)
            else:
                runs.append((s, 1))
        return runs


class Pipeline(BaseModel):
    """One data-parallel replica of the model: its stages, and the micro-batches it processes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stages: tuple[Stage, ...] = Field(min_length=1)
    micro_batches: int = Field(ge=1, description="micro-batches per iteration")
    micro_batch_sequences: int = Field(ge=1, description="sequences per micro-batch of the whole pipeline, split "
                                                       "over each layer's data-parallel replicas")

    @property
    def samples(self) -> int:
        return self.micro_batches * self.micro_batch_sequences

    @property
    def even_widths(self) -> bool:
        """Whether every stage has the same number of ranks (then stages hand over rank by rank)."""
        return len({len(stage.ranks) for stage in self.stages}) == 1

    def own_schedule(self, chunks: int = 1, runs: int = 1) -> bool:
        """Whether the runtime runs this pipeline (`chunks` model chunks per rank, `runs` schedules a step)
        with its own GPipe / 1F1B schedule (`plait.runtime.pipeline_uneven`) instead of
        torch.distributed.pipelining's: stages of different widths, or fewer micro-batches a schedule than
        stages (torch's schedules need one per stage)."""
        pp = len(self.stages) // chunks
        return pp > 1 and (not self.even_widths or self.micro_batches // runs < pp)

    def per_replica(self, s: Strategy) -> int:
        """Sequences per micro-batch on one data-parallel replica of a layer of strategy `s` (the `mbs` of
        the --strategy shorthand)."""
        return self.micro_batch_sequences // s.dp


class Plan(BaseModel):
    """A complete parallel execution plan for one training iteration."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, raw: object) -> object:
        """Plans of older versions read as this version's; newer ones are refused."""
        if not isinstance(raw, dict):
            return raw
        version = raw.get("version", 1)
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"version must be a positive integer, got {version!r}")
        if version > PLAN_VERSION:
            raise ValueError(f"plan version {version} is newer than this plait reads ({PLAN_VERSION}); upgrade plait")
        if version == 1:
            raw = {**raw, "pipelines": [
                {("micro_batch_sequences" if k == "micro_batch_size" else k): v for k, v in p.items()}
                if isinstance(p, dict) else p for p in raw.get("pipelines", [])]}
        if version == 9 and "recompute_modules" in raw:
            raw = _modules_onto_strategies(raw)
        return {**raw, "version": PLAN_VERSION}  # versions 2 -> ... -> 8 add fields with defaults

    version: int = PLAN_VERSION
    model: str = Field(description="name of the model the plan was made for")
    model_fingerprint: str | None = Field(None, description="ModelSpec.fingerprint of that model (None: unchecked)")
    seq_len: int = Field(ge=1, description="tokens per sequence")
    global_batch: int = Field(ge=1, description="sequences per optimizer step")
    schedule: Schedule = "1f1b"
    chunks: int = Field(1, ge=1, description="model chunks per device (Megatron's virtual pipeline size)")
    precision: Precision = "bf16"
    overlap_grad_reduce: bool = Field(True, description="reduce gradients during the backward pass")
    expert_load: float = Field(1.0, ge=1.0, allow_inf_nan=False,
                               description="routed tokens of the busiest expert rank over the mean (MoE layers): "
                                           "1 with balanced routing, the capacity factor with padded experts")
    dispatcher: Dispatcher = Field("alltoall", description="how MoE layers move routed tokens: alltoall "
                                   "(Megatron's all-to-all dispatcher and plait's runtime: every routed copy "
                                   "travels, over the network too) or deepep (DeepEP, HybridEP: a token travels "
                                   "once per destination rank in a node, once per destination node across)")
    routing: Routing = Field("random", description="which experts a token's top-k picks are: random (distinct "
                             "experts drawn at random, as balanced routers and Megatron's forced balance give) "
                             "or contiguous (top-k consecutive experts, NeMo AutoModel's fake balanced gate)")
    grad_reduce: GradReduce = Field("auto", description="precision gradients are reduced in: auto (the "
                                    "precision's gradient bytes: fp32 under bf16), fp32 or bf16 (FSDP's reduce_dtype)")
    p2p: P2p = Field("async", description="how pipeline stages exchange activations: async (sends overlap "
                     "compute), megatron (Megatron-LM without overlap_p2p_comm: synchronous exchanges, and a "
                     "tensor-parallel stage without sequence parallelism sends 1/tp of its activation per rank, "
                     "all-gathered on arrival) or torch (torch.distributed.pipelining's synchronous "
                     "exchanges: each op's sends batched with the step's receives and waited on before the "
                     "next op, whole activations); the runtime runs all three")
    schedule_runs: int = Field(1, ge=1, description="pipeline schedules run one after another per optimizer "
                               "step, each over micro_batches / schedule_runs micro-batches with its own fill and "
                               "drain; gradients are synchronised once, after the last (NeMo AutoModel's "
                               "gradient accumulation steps under pipeline parallelism)")
    ep_overlap: bool = Field(False, description="MoE layers' token exchange runs beside another micro-batch's "
                             "compute: Megatron-LM's --overlap-moe-expert-parallel-comm, which pairs each "
                             "steady-state forward with an earlier micro-batch's backward (priced, "
                             "Calibration.ep_overlap_hidden; the runtime does not overlap them and refuses it)")
    pipelines: tuple[Pipeline, ...] = Field(min_length=1)

    def own_schedule(self, pipeline: int) -> bool:
        """Whether the runtime runs pipeline `pipeline` with its own schedule (`Pipeline.own_schedule`); every
        pipeline of several stages does under p2p=megatron, whose tensor-parallel scatter/gather and
        blocking exchanges in every schedule torch's schedules lack."""
        pipe = self.pipelines[pipeline]
        return pipe.own_schedule(self.chunks, self.schedule_runs) or \
            (self.p2p == "megatron" and len(pipe.stages) > 1)

    def runtime_p2p(self) -> P2p:
        """How the runtime's schedules exchange this plan's activations (the p2p to price a plan that does not
        ask for Megatron-LM's by): "torch" where torch's Schedule1F1B runs a pipeline of several stages (its
        steady state is synchronous, see SYNC_P2P), else "async" (ScheduleGPipe, torch >= 2.10's
        ScheduleInterleaved1F1B and the runtime's own schedules send without waiting)."""
        one_chunk = self.schedule != "gpipe" and self.chunks == 1
        torch_1f1b = any(len(p.stages) > 1 and not p.own_schedule(self.chunks, self.schedule_runs)
                         for p in self.pipelines)
        return "torch" if one_chunk and torch_1f1b else "async"

    def with_runtime_p2p(self) -> Plan:
        """This plan with `p2p` as the runtime's schedules exchange (`runtime_p2p`): how planners price the
        plans they emit."""
        return self.model_copy(update={"p2p": self.runtime_p2p()})

    def run_micro_batches(self, pipeline: int) -> int:
        """Micro-batches of one of pipeline `pipeline`'s `schedule_runs` schedule runs a step."""
        return self.pipelines[pipeline].micro_batches // self.schedule_runs

    @cached_property
    def pp(self) -> int:
        """Devices groups per pipeline of the first pipeline (stages // chunks)."""
        return len(self.pipelines[0].stages) // self.chunks

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Every rank the plan uses, sorted."""
        return tuple(sorted({r for p in self.pipelines for s in p.stages for r in s.ranks}))

    def to_json(self) -> str:
        return self.model_dump_json(indent=1)

    def stamped(self, model: ModelSpec) -> Plan:
        """This plan recording `model`'s name and architecture fingerprint (checked when it is read back)."""
        return self.model_copy(update={"model": model.name, "model_fingerprint": model.fingerprint})

    def file_text(self, path: str | Path) -> str:
        """The plan as the text of a file at `path`: YAML for .yaml/.yml, else JSON."""
        if Path(path).suffix in (".yaml", ".yml"):
            return yaml.safe_dump(json.loads(self.model_dump_json()), sort_keys=False)
        return self.to_json() + "\n"

    def save(self, path: str | Path) -> None:
        """Write JSON (or YAML for .yaml/.yml) atomically."""
        write_atomically(path, self.file_text(path))


def load_plan(path: str | Path) -> Plan:
    """Read a plan from JSON or YAML; errors name the file and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise PlaitError(f"cannot read plan {str(path)!r}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError:
        raise PlaitError(f"plan {str(path)!r} is not a text file; give a plan JSON or YAML") from None
    is_yaml = path.suffix in (".yaml", ".yml")
    try:
        raw = yaml.safe_load(text) if is_yaml else json.loads(text)
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise PlaitError(f"plan {str(path)!r} is not valid {'YAML' if is_yaml else 'JSON'}: "
                         f"{str(exc).splitlines()[0]}") from None
    try:
        return Plan.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise PlaitError(f"plan {str(path)!r}: {where}: {err['msg']}") from None


# ---- validation against a model and a cluster ---------------------------------------------------

def validate_plan(plan: Plan, model: ModelSpec, cluster: Cluster) -> None:
    """Raise PlaitError naming the first thing that makes `plan` impossible for `model` on `cluster`."""
    if plan.model_fingerprint is not None and plan.model_fingerprint != model.fingerprint:
        raise PlaitError(f"the plan was made for {plan.model}, whose architecture differs from {model.name}'s; "
                         f"give --model {plan.model}, or make a plan for {model.name} with `plait plan`")
    used: dict[int, str] = {}  # rank -> the stage that uses it
    samples = 0
    for pi, pipe in enumerate(plan.pipelines):
        where = f"pipeline {pi}"
        stages = pipe.stages
        if pipe.micro_batches * len(stages) > MAX_MICRO_BATCH_STAGES:
            raise PlaitError(f"{where} runs {pipe.micro_batches} micro-batches over {len(stages)} stage(s) per "
                             f"step; plait handles at most {MAX_MICRO_BATCH_STAGES} micro-batches x stages: raise "
                             "the micro-batch size (mbs) or lower the global batch (gbs)")
        if len(stages) % plan.chunks:
            raise PlaitError(f"{where} has {len(stages)} stages, not a multiple of chunks={plan.chunks}; "
                             "give pp * chunks stages")
        pp = len(stages) // plan.chunks
        if plan.chunks > 1 and pp == 1:
            raise PlaitError(f"chunks={plan.chunks} (vpp) interleaves model chunks over pipeline stages, but "
                             f"{where} has pp=1; set vpp=1 (chunks=1) or pp > 1")
        if plan.chunks > 1 and plan.schedule != "interleaved":
            raise PlaitError(f"chunks={plan.chunks} needs schedule 'interleaved'; set chunks=1 (vpp=1) "
                             "or schedule=interleaved")
        if pipe.micro_batches % plan.schedule_runs:
            raise PlaitError(f"{where}: {pipe.micro_batches} micro-batches do not split into schedule_runs="
                             f"{plan.schedule_runs} equal schedule runs; change schedule_runs, gbs or mbs")
        per_run = plan.run_micro_batches(pi)
        if plan.schedule == "interleaved" and pp > 1 and per_run % pp:
            raise PlaitError(f"{where}: interleaved 1F1B needs micro-batches a schedule run ({per_run}) to "
                             f"be a multiple of the pipeline degree ({pp}); change gbs, mbs or schedule_runs")
        expected = 0
        for si, stage in enumerate(stages):
            sw = f"{where} stage {si}"
            if stage.layers[0] != expected:
                raise PlaitError(f"{sw} starts at layer {stage.layers[0]}, expected {expected}; stages must "
                                 "cover the layers contiguously in model order")
            expected = stage.layers[1]
            if si >= pp and stage.ranks != stages[si % pp].ranks:
                raise PlaitError(f"{sw} is chunk {si // pp} of device group {si % pp} and must use the same "
                                 f"ranks as stage {si % pp}")
            if si < pp:
                _validate_ranks(stage.ranks, used, sw, cluster)
            if stage.layers[1] > model.layers:
                break
            seen: dict[tuple[Strategy, Block], int] = {}
            for layer in range(*stage.layers):  # each distinct (strategy, layer shape) once, in layer order
                seen.setdefault((stage.strategy(layer), model.stack[layer]), layer)
            for (strategy, block), layer in seen.items():
                _validate_strategy(strategy, block, len(stage.ranks), pipe.micro_batch_sequences, plan,
                                   f"{sw} layer {layer} ({block.kind})")
                if strategy.offload == "nvme" and cluster.host_side.nvme_bandwidth <= 0:
                    raise PlaitError(f"{sw} layer {layer} offloads to NVMe, but cluster {cluster.name} has no NVMe; "
                                     "give its nodes nvme_tb and nvme_gbps in the cluster YAML, or use offload=params")
        if expected != model.layers:
            raise PlaitError(f"{where} covers layers 0..{expected - 1} but {model.name} has {model.layers} "
                             f"layers; make the last stage end at {model.layers}")
        samples += pipe.samples
    if samples != plan.global_batch:
        raise PlaitError(f"pipelines process {samples} sequences per step but global_batch is "
                         f"{plan.global_batch}; micro_batches x micro_batch_sequences must add up to it")


def _validate_ranks(ranks: tuple[int, ...], used: dict[int, str], where: str, cluster: Cluster) -> None:
    lo, hi = min(ranks), max(ranks)
    if lo < 0 or hi >= cluster.world_size:
        bad = lo if lo < 0 else hi
        raise PlaitError(f"{where} uses rank {bad}, but cluster {cluster.name} has ranks "
                         f"0..{cluster.world_size - 1}; use a larger cluster or fewer ranks")
    common = used.keys() & set(ranks)
    if common:
        clash = min(common)
        raise PlaitError(f"rank {clash} is used by both {used[clash]} and {where}; give each stage its own ranks")
    used.update(dict.fromkeys(ranks, where))


def strategy_problem(s: Strategy, block: Block, devices: int, mbs: int, seq_len: int) -> str | None:
    """Why strategy `s` cannot run `block` on a stage of `devices` ranks whose micro-batches hold `mbs`
    sequences of `seq_len` tokens, as a message that says what would fix it (None when it can)."""
    if s.devices != devices:
        return (f"dp*tp*cp = {s.dp}*{s.tp}*{s.cp} = {s.devices} but the stage has {devices} ranks; degrees must "
                "multiply to the stage's device count")
    why = block.tp_divides(s.tp)
    if why:
        return f"{why}; pick a tp that divides them"
    seq = block.seq(seq_len)
    if s.sp and s.tp == 1:
        return "sequence parallelism (sp) needs tp > 1; set sp=0 or raise tp"
    if s.sp and seq % s.tp:
        return f"sp splits seq_len={seq} (the layer's tokens) over tp={s.tp}; pick tp dividing it"
    if seq % s.cp or seq_len % s.cp:
        return f"cp={s.cp} does not divide seq_len={seq} (the layer's tokens per sequence)"
    if s.cp > 1 and s.cp_mode == "ulysses" and block.has_attention and \
            ((block.heads // s.tp) % s.cp or (block.kv_heads // s.tp) % s.cp):
        return (f"Ulysses cp={s.cp} must divide the heads per tp rank ({block.heads // s.tp} query, "
                f"{block.kv_heads // s.tp} kv); use cp_mode=ring or a smaller cp")
    if mbs % s.dp:
        return (f"micro-batch of {mbs} sequences cannot be split over dp={s.dp}; make the micro-batch size a "
                "multiple of dp")
    if s.shard and (s.zero == 0 or (s.dp * s.cp) % s.shard):
        return (f"shard={s.shard} needs ZeRO (zero >= 1) and must divide the dp*cp = {s.dp * s.cp} data-parallel "
                "ranks; set zero and pick a shard group size that divides them (0: all of them)")
    if s.devices % (s.ep * s.expert_tp):
        return (f"ep*etp = {s.ep}*{s.expert_tp} does not divide the stage's {s.devices} ranks; pick expert degrees "
                "whose product divides dp*cp*tp")
    return kind_problem(s, block) or expert_problem(s, block)


def expert_problem(s: Strategy, block: Block) -> str | None:
    """Why the expert degrees of `s` cannot lay out `block`'s experts (None when they can; layers without
    experts ignore ep and etp)."""
    if block.kind != "moe":
        return None
    if block.experts % s.ep:
        return f"ep={s.ep} does not divide the {block.experts} experts; pick an ep that divides them"
    if block.expert_ffn % s.expert_tp:
        return (f"etp={s.expert_tp} does not divide the expert width {block.expert_ffn}; pick an etp that divides "
                "it")
    if s.tp > 1 and not s.sp:
        return "an MoE layer with tp > 1 needs sequence parallelism (sp=1), as Megatron's token dispatch does"
    return None


TOKENLESS_KINDS = ("patch_embed", "vision", "projector")
"""Kinds whose input carries an image and the text together (`plait.models.vision`): no token splits."""
BIDIRECTIONAL_KINDS = ("encoder", "cross_decoder")
"""Kinds with attention that is not causal self-attention over the layer's own tokens."""


def kind_problem(s: Strategy, block: Block) -> str | None:
    """Why strategy `s` cannot run a layer of `block`'s kind whatever the shapes (None when it can): the
    vision tower and projector split no tokens, and ring attention is causal self-attention only."""
    if block.kind in TOKENLESS_KINDS and (s.sp or s.cp > 1):
        return (f"a {block.kind} layer carries the image and the text together and splits no tokens; use sp=0 "
                "and cp=1 for the vision tower and projector")
    if block.kind in BIDIRECTIONAL_KINDS and s.ring:
        return (f"ring attention is causal self-attention only, and a {block.kind} layer attends both ways; use "
                "cp_mode=ulysses")
    return None


def _validate_strategy(s: Strategy, block: Block, devices: int, mbs: int, plan: Plan, where: str) -> None:
    why = strategy_problem(s, block, devices, mbs, plan.seq_len)
    if why:
        raise PlaitError(f"{where}: {why}")


# ---- the --strategy shorthand ----------------------------------------------------------------------

_STRATEGY_KEYS = ("tp", "pp", "dp", "cp", "mbs", "gbs", "recompute", "sp", "zero", "vpp", "schedule",
                  "cp_mode", "precision", "overlap", "ep", "etp", "expert_load", "shard", "grad_reduce", "p2p",
                  "moe_comm", "swap", "offload", "dispatcher", "routing", "schedule_runs", "ep_overlap",
                  "recompute_modules")


def parse_strategy(text: str) -> dict[str, str]:
    """Split `tp=8,pp=8,...` into a dict, rejecting unknown keys."""
    out: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _STRATEGY_KEYS:
            raise PlaitError(f"--strategy: cannot read {item!r}; use key=value with keys {', '.join(_STRATEGY_KEYS)}")
        if key in out:
            raise PlaitError(f"--strategy: {key} is given twice ({key}={out[key]} and {item}); give each key once")
        out[key] = value.strip()
    return out


def _int(d: dict[str, str], key: str, default: int) -> int:
    if key not in d:
        return default
    try:
        v = int(d[key])
    except ValueError:
        raise PlaitError(f"--strategy: {key} must be an integer, got {d[key]!r}") from None
    if v < (0 if key in ("zero", "etp", "shard") else 1):
        raise PlaitError(f"--strategy: {key} must be positive, got {v}")
    return v


def _bool(d: dict[str, str], key: str, default: bool) -> bool:
    if key not in d:
        return default
    v = d[key].lower()
    if v not in ("0", "1", "true", "false", "on", "off"):
        raise PlaitError(f"--strategy: {key} must be 0 or 1, got {d[key]!r}")
    return v in ("1", "true", "on")


def split_layers(layers: int, parts: int) -> list[int]:
    """Split `layers` into `parts` contiguous counts as evenly as possible (earlier parts get fewer, since
    the first stage also holds the embedding and keeps the most activations)."""
    base, extra = divmod(layers, parts)
    return [base + (1 if i >= parts - extra else 0) for i in range(parts)]


def recut_chunks(plan: Plan, chunk_layers: list[int], model: ModelSpec, cluster: Cluster) -> Plan:
    """`plan` with its one pipeline's chunks re-cut to hold `chunk_layers[j]` layers each, in model order
    (chunk j keeps its ranks and strategies: the device group of chunk j % pp). Expresses uneven splits such
    as Llama 3's pipeline, which holds one layer fewer on the first and last stage (Dubey et al. 2024,
    Sec. 3.3.2)."""
    if len(plan.pipelines) != 1:
        raise PlaitError(f"chunk_layers: the plan has {len(plan.pipelines)} pipelines; re-cut plans of one")
    pipe = plan.pipelines[0]
    if len(chunk_layers) != len(pipe.stages) or min(chunk_layers) < 1 or sum(chunk_layers) != model.layers:
        raise PlaitError(f"chunk_layers {chunk_layers} must give {len(pipe.stages)} counts (pp*vpp), each >= 1, "
                         f"summing to the {model.layers} layers of {model.name}; fix the counts")
    if any(len(stage.strategies) != 1 for stage in pipe.stages):
        raise PlaitError("chunk_layers: re-cut only plans with one strategy per stage (a uniform plan)")
    stages, start = [], 0
    for stage, n in zip(pipe.stages, chunk_layers, strict=True):
        stages.append(Stage(layers=(start, start + n), ranks=stage.ranks, strategies=stage.strategies))
        start += n
    recut = plan.model_copy(update={"pipelines": (pipe.model_copy(update={"stages": tuple(stages)}),)})
    validate_plan(recut, model, cluster)
    return recut


def _number(d: dict[str, str], key: str, default: str, ok: Callable[[float], bool], what: str) -> float:
    """The shorthand's number `key` (`default` when absent), refused unless `ok` (it must be `what`)."""
    raw = d.get(key, default)
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not ok(value):
        raise PlaitError(f"--strategy: {key} must be {what}, got {raw!r}")
    return value


def _choice(d: dict[str, str], key: str, allowed: tuple[str, ...], default: str | None = None) -> str:
    """The shorthand's `key`, one of `allowed` (`default`, else the first, when absent)."""
    value = d.get(key, default or allowed[0])
    if value not in allowed:
        raise PlaitError(f"--strategy: {key} must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {value!r}")
    return value


def _recompute_modules(d: dict[str, str], recompute: str) -> tuple[str, ...]:
    """The shorthand's `recompute_modules`: Megatron's module names joined by `+` (none when absent), for a
    strategy of recompute mode `recompute`."""
    names = tuple(n.strip() for n in d.get("recompute_modules", "").split("+") if n.strip())
    for name in names:
        if name == "core_attn":
            raise PlaitError("--strategy: recompute_modules core_attn is recompute=selective; give that instead")
        if name not in RECOMPUTE_MODULES:
            raise PlaitError(f"--strategy: recompute_modules {name!r} is not one of {', '.join(RECOMPUTE_MODULES)}; "
                             "join several with +")
    if len(set(names)) != len(names):
        raise PlaitError(f"--strategy: recompute_modules names a module twice ({'+'.join(names)}); give each once")
    if names and recompute not in KEEPS_ACTIVATIONS:
        raise PlaitError(f"--strategy: recompute_modules need recompute none or selective; recompute={recompute} "
                         "runs those modules again already (drop recompute_modules)")
    return names


def _expert_load(d: dict[str, str]) -> float:
    """The shorthand's `expert_load` (>= 1; 1 when absent)."""
    return _number(d, "expert_load", "1", lambda v: 1.0 <= v < math.inf,
                   "a number >= 1 (the busiest expert rank's routed tokens over the mean)")


def _swap(d: dict[str, str]) -> float:
    """The shorthand's `swap` (a share from 0 to 1; 0 when absent)."""
    return _number(d, "swap", "0", lambda v: 0.0 <= v <= 1.0, "a share from 0 to 1 of the saved activations")


@lru_cache(maxsize=4096)
def _uniform_stages(layers: int, pp: int, vpp: int, strategy: Strategy) -> tuple[Stage, ...]:
    """The stages of a uniform plan: `layers` split evenly into pp * vpp chunks, chunk j on device group
    j mod pp (each of `strategy`'s devices, in rank order), all with `strategy` (cached: a baseline builds
    the same stages for every micro-batch size)."""
    per_group = strategy.devices
    stages = []
    start = 0
    for j, n in enumerate(split_layers(layers, pp * vpp)):
        group = j % pp
        ranks = tuple(range(group * per_group, (group + 1) * per_group))
        stages.append(Stage(layers=(start, start + n), ranks=ranks, strategies=(strategy,)))
        start += n
    return tuple(stages)


def uniform_plan(text: str, model: ModelSpec, cluster: Cluster, seq_len: int, validate: bool = True) -> Plan:
    """Build a uniform Megatron-style plan from the `--strategy` shorthand.

    Keys: tp, pp, dp, cp, mbs (sequences per data-parallel replica per micro-batch), gbs, recompute
    (none|selective|attn_kept|gemm_kept|full), sp, zero, vpp (model chunks per device), ep and etp (expert
    parallel and expert tensor parallel degrees of MoE layers; etp defaults to tp), moe_comm (alltoall|lsh:
    LSH-MoE compression of the routed tokens), expert_load, dispatcher (alltoall|deepep) and routing
    (random|contiguous) (see Plan), shard (ZeRO's shard group, HSDP: 0 all of dp*cp), schedule_runs (pipeline
    schedules a step, see Plan), ep_overlap (0|1: Megatron's expert-parallel overlap, see Plan),
    recompute_modules (Megatron's named modules joined by +, e.g. mla_up_proj+mlp, see Strategy), swap (share of
    saved activations swapped to host), offload (none|optim|params|nvme), and optionally schedule, cp_mode,
    precision, grad_reduce (auto|fp32|bf16), p2p (runtime, the default: as the runtime's schedules exchange,
    Plan.runtime_p2p; async|megatron|torch), overlap. dp defaults to the devices left by tp*pp*cp; gbs to 4*pp
    micro-batches. Without `validate` the plan is not checked against the model and cluster (for layouts valid
    by construction).
    """
    d = parse_strategy(text)
    tp, pp, cp = _int(d, "tp", 1), _int(d, "pp", 1), _int(d, "cp", 1)
    world = cluster.world_size
    if world % (tp * pp * cp) and "dp" not in d:
        raise PlaitError(f"--strategy: tp*pp*cp = {tp * pp * cp} does not divide the {world} devices of "
                         f"{cluster.name}; change the degrees")
    dp = _int(d, "dp", world // (tp * pp * cp))
    if tp * pp * dp * cp != world:
        raise PlaitError(f"--strategy: tp*pp*dp*cp = {tp}*{pp}*{dp}*{cp} = {tp * pp * dp * cp} but "
                         f"{cluster.name} has {world} devices; set dp={world // (tp * pp * cp)} or change the "
                         "cluster")
    mbs = _int(d, "mbs", 1)
    vpp = _int(d, "vpp", 1)
    gbs = _int(d, "gbs", mbs * dp * (4 * pp if pp > 1 else 1))
    if gbs % (mbs * dp):
        raise PlaitError(f"--strategy: gbs={gbs} is not a multiple of mbs*dp = {mbs * dp}; change gbs")
    recompute = _choice(d, "recompute", RECOMPUTE_MODES)
    schedule = _choice(d, "schedule", ("gpipe", "1f1b", "interleaved"), "interleaved" if vpp > 1 else "1f1b")
    precision = _choice(d, "precision", ("bf16", "fp16", "fp32", "bf16-pure"))
    cp_mode = _choice(d, "cp_mode", ("ulysses", "ring"))
    grad_reduce = _choice(d, "grad_reduce", ("auto", "fp32", "bf16"))
    p2p = _choice(d, "p2p", ("runtime", "async", "megatron", "torch"))
    moe_comm = _choice(d, "moe_comm", ("alltoall", "lsh"))
    offload = _choice(d, "offload", ("none", "optim", "params", "nvme"))
    zero = _int(d, "zero", 0)
    if zero > 3:
        raise PlaitError(f"--strategy: zero must be 0..3, got {zero}")
    if pp * vpp > model.layers:
        raise PlaitError(f"--strategy: pp*vpp = {pp * vpp} chunks but {model.name} has {model.layers} layers")
    strategy = Strategy(dp=dp, tp=tp, cp=cp, sp=_bool(d, "sp", False), cp_mode=cp_mode, zero=zero,
                        recompute=recompute, ep=_int(d, "ep", 1), etp=_int(d, "etp", 0),  # type: ignore[arg-type]
                        shard=_int(d, "shard", 0), moe_comm=moe_comm, swap=_swap(d),  # type: ignore[arg-type]
                        offload=offload, recompute_modules=_recompute_modules(d, recompute))  # type: ignore[arg-type]
    stages = _uniform_stages(model.layers, pp, vpp, strategy)
    plan = Plan(model=model.name, seq_len=seq_len, global_batch=gbs, schedule=schedule, chunks=vpp,  # type: ignore[arg-type]
                precision=precision, overlap_grad_reduce=_bool(d, "overlap", True),  # type: ignore[arg-type]
                expert_load=_expert_load(d),
                dispatcher=_choice(d, "dispatcher", ("alltoall", "deepep")),  # type: ignore[arg-type]
                routing=_choice(d, "routing", ("random", "contiguous")),  # type: ignore[arg-type]
                grad_reduce=grad_reduce,  # type: ignore[arg-type]
                p2p="async" if p2p == "runtime" else p2p,  # type: ignore[arg-type]
                schedule_runs=_int(d, "schedule_runs", 1), ep_overlap=_bool(d, "ep_overlap", False),
                pipelines=(Pipeline(stages=stages, micro_batches=gbs // (mbs * dp),
                                    micro_batch_sequences=mbs * dp),))
    if p2p == "runtime":
        plan = plan.with_runtime_p2p()
    if validate:
        validate_plan(plan, model, cluster)
    return plan
