"""Galvatron interchange: its searched strategy files become plait Plans and back, and its profiles
become plait calibration constants. Formats are those of hetu-galvatron 2.4.0 (PKU-DAIR/Hetu-Galvatron).

Strategy file (`galvatron_config_*.json`, written by Galvatron's search engine `save_results`, read by
`get_hybrid_parallel_configs_api`). Per-layer lists are comma-separated strings, one entry per block:

* `pp_deg`: pipeline stages. Stage k runs on ranks [k*W/pp, (k+1)*W/pp) of the W devices
  (`gen_pp_group_dist` puts ranks i, i+W/pp, ... in one pipeline).
* `pp_division`: blocks per stage (default: L//pp each of the L blocks, the rest on the last stage).
* `tp_sizes_enc`: tensor-parallel degree of each block; with `use_sp` = 1 the same number is instead the
  degree of Ulysses sequence parallelism (all-to-all over heads) and the block has no tensor parallelism.
* `tp_consecutive_flags`: 1 = TP (or Ulysses) groups are consecutive ranks and data parallelism strides over
  them (plait's tp-fastest order); 0 = TP groups stride by the data-parallel degree.
* `dp_types_enc`: 0 = the `default_dp_type` (`ddp` = no sharding, `zero2` = FSDP SHARD_GRAD_OP,
  `zero3` = FULL_SHARD), 1 = "SDP" = ZeRO-3 (FULL_SHARD).
* `checkpoint`: 1 = the whole block is recomputed in backward (full recomputation).
* `global_bsz`: sequences per step; `chunks`: micro-batches per step (the batch is cut into `chunks`
  pieces; with pp_deg 1 this is gradient accumulation).
* `pipeline_type`: `pipedream_flush` (1F1B) or `gpipe`; absent = Galvatron's launch default, gpipe.
* `vtp`, `vsp`, `embed_sdp`: the embedding and LM head's TP degree, whether that degree is Ulysses
  instead, and whether they use ZeRO-3 (absent: 1, 0, 0, Galvatron's defaults).

Megatron sequence parallelism and the training precision are launch flags of Galvatron
(`--sequence-parallel`, `--mixed_precision`), not fields of the file: `load_galvatron_config` takes them as
arguments (the precision is also read from a `_bf16`/`_fp16`/`_fp32` token of the file name), and
`launch_flags` gives them for a plan written out. `galvatron_problem` says why a plan cannot be written;
`galvatron_limits` and `expressible` restrict a search to plans that can.

Profiles (written by Galvatron's `ModelProfiler` and `HardwareProfiler`):

* `computation_profiling_<prec>_<model>.json`: `layertype_<i>_bsz<b>[_seq<s>]` = forward time of one
  block per sequence in milliseconds, measured forward-only on one GPU as the time difference between
  two layer counts divided by batch and layer difference; `layertype_other_...` = the rest (embedding,
  head) per sequence. Older static files give `layertype_<i>` alone; the sequence length is then the
  `seqlen<s>` of the file name.
* `memory_profiling_<prec>_<model>.json`: `layertype_<i>[_sp]` = {`parameter_size`: MiB of one block's
  fp32 parameters (model states / 4), `tp_activation_per_bsz_dict`: {tp: MiB of activations one block
  keeps per sequence on one device of a TP group of that size, `checkpoint`: the same with full
  recomputation}}, either flat (one sequence length) or keyed by sequence length. `_sp` = measured with
  Megatron sequence parallelism. `other_memory_pp_off` (one stage), `other_memory_pp_on_first` and
  `_last` (the edge stages of a pipeline) = {`model_states`: MiB of the embedding's and head's model states,
  `activation`: MiB per sequence of the peak beside the blocks' saved activations}, each a number (old
  files: tp 1) or keyed by vocabulary-parallel degree, flat or keyed by sequence length. Galvatron's
  profiler derives all of these from raw runs (`<pp>_<tp>_<dp>[_c][_vtp][_sp]`: allocated MiB after the
  step and at the peak, for two layer counts) as differences: they are measurements.
* `allreduce_bandwidth_<N>nodes_<G>gpus_per_node.json`: `allreduce_size_<n>_consec_<0|1>` = nccl-tests
  "Avg bus bandwidth" in GB/s (1e9 B/s), averaged over Galvatron's default 16-512 MiB message sweep, of
  groups of n consecutive ranks (1) or ranks strided by W/n (0).
* `p2p_bandwidth_...json`: `pp_size_<p>` = nccl-tests sendrecv bus bandwidth, GB/s, between ranks W/p apart.
* `sp_time_...json`: `allreduce|all2all_size_<n>_<m>MB_time` = milliseconds for an m MiB message over
  n consecutive ranks.
* `overlap_coefficient.json`: `overlap_coe` = how many times slower computation or communication runs when
  both run at once (the larger of the two slowdowns, measured with a GEMM and an all-reduce; >= 1).

Layer types. Galvatron numbers the layer types of a model in the order its layers run (`layernum_list`:
T5 = [encoder layers, decoder layers], Swin = one type per stage); its profiles key each type
`layertype_<i>`, and its strategy files list every layer of every type in that order. plait maps
Galvatron's layer type i to the model's i-th layer kind in order of first appearance (`layer_types`:
`t5-11b` is encoder = 0, cross_decoder = 1; a decoder-only model, windowed or not, has one type; a profile
whose types are shapes of one kind, like Swin's stages, does not fit a plait model and is refused). The
strategy file itself has no per-type fields, so a plan of a multi-kind model is exported and imported as
per-layer lists over `model.stack`.

None of these files names the GPU it was measured on: `load_galvatron_profiles` takes the GPU type from the
caller and `to_calibration` refuses a cluster of any other GPU type.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from plait.cost.calibration import Calibration
from plait.cost.comm import SINGLE
from plait.cost.layer import BlockContext
from plait.cost.measured_memory import EdgeMemory, MeasuredMemory
from plait.cost.precision import PRECISIONS
from plait.cost.price import price
from plait.errors import PlaitError
from plait.io import write_atomically
from plait.plan import Pipeline, Plan, Stage, Strategy, validate_plan
from plait.planner.space import SpaceLimits
from plait.spec.cluster import GB, Cluster
from plait.spec.layers import Block
from plait.spec.model import ModelSpec

MIB = 2**20

_DP_TYPES = {"ddp": 0, "zero2": 2, "zero3": 3}
_SCHEDULES = {"pipedream_flush": "1f1b", "gpipe": "gpipe"}
GALVATRON_PRECISIONS = ("bf16", "fp16", "fp32")
"""Galvatron's --mixed_precision choices (mixed precision over fp32 master weights, or fp32)."""
_PRECISION_TOKEN = re.compile(r"_(bf16|fp16|fp32)(?=_|\.json$|$)")


LayerType = tuple[tuple[Block, int], ...]
"""One Galvatron layer type in plait: the distinct layers of one kind, each with how often it occurs."""


def layer_types(model: ModelSpec) -> tuple[LayerType, ...]:
    """Galvatron's layer types of `model`: type i is the model's i-th layer kind in order of first appearance
    (its distinct Blocks and their counts; a kind with several shapes, e.g. Gemma-2's windowed and global
    decoder layers, is one type)."""
    return tuple(tuple((b, n) for b, n in model.block_counts if b.kind == kind)
                 for kind in model.kind_counts())


def _layers_text(model: ModelSpec) -> str:
    """`48 layers (24 encoder + 24 cross_decoder)`, or `32 layers` for a model of one kind."""
    counts = model.kind_counts()
    if len(counts) == 1:
        return f"{model.layers} layers"
    return f"{model.layers} layers ({' + '.join(f'{n} {kind}' for kind, n in counts.items())})"


class GalvatronVocabWarning(UserWarning):
    """The embedding and head are laid out differently in Galvatron (vtp, vsp, embed_sdp) than plait can say:
    a plait plan runs them with the strategies of the first and last blocks."""


# ==== strategy files ================================================================================

def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise PlaitError(f"cannot read {what} {str(path)!r}: {exc.strerror}; check the path") from None
    except UnicodeDecodeError:
        raise PlaitError(f"{what} {str(path)!r} is not a text file") from None
    except json.JSONDecodeError as exc:
        raise PlaitError(f"{what} {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise PlaitError(f"{what} {str(path)!r} is not a JSON object")
    return raw


def _int_field(cfg: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
    if key not in cfg:
        if default is None:
            raise PlaitError(f"{where} has no {key!r}; is it a galvatron_config_*.json strategy file?")
        return default
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlaitError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _int_list(cfg: dict[str, Any], key: str, where: str, n: int | None,
              default: int | None = None, layers: str = "") -> list[int]:
    """Comma-separated integers of `key`; `n` entries unless None; `layers` says what the n entries are."""
    if key not in cfg:
        if default is None or n is None:
            raise PlaitError(f"{where} has no {key!r}; is it a galvatron_config_*.json strategy file?")
        return [default] * n
    value = cfg[key]
    try:
        items = [int(v) for v in str(value).split(",")]
    except ValueError:
        raise PlaitError(f"{where}: {key} must be comma-separated integers, got {value!r}") from None
    if n is not None and len(items) != n:
        raise PlaitError(f"{where}: {key} has {len(items)} entries but the model has {layers or f'{n} layers'}; "
                         "use a strategy searched for this model")
    return items


def _flags(values: list[int], key: str, where: str) -> None:
    bad = [v for v in values if v not in (0, 1)]
    if bad:
        raise PlaitError(f"{where}: {key} entries must be 0 or 1, got {bad[0]}")


def _vocab_mismatch(plan: Plan, tp: int, cp: int, zero: int) -> str | None:
    """Text saying how the embedding/head layout (tp, cp, zero) differs from plait's rule, or None."""
    first = plan.pipelines[0].stages[0]
    last = plan.pipelines[0].stages[-1]
    ends = {"first": first.strategy(first.layers[0]), "last": last.strategy(last.layers[1] - 1)}
    diffs = [f"the {name} block has tp{s.tp} cp{s.cp} zero{s.zero}" for name, s in ends.items()
             if (s.tp, s.cp, s.zero) != (tp, cp, zero)]
    if not diffs:
        return None
    return (f"Galvatron runs the embedding and LM head with tp{tp} cp{cp} zero{zero} but plait runs them with "
            f"the strategies of the first and last blocks ({'; '.join(diffs)})")


def load_galvatron_config(path: str | Path, model: ModelSpec, cluster: Cluster, seq_len: int, *,
                          precision: str | None = None, sequence_parallel: bool = False,
                          strict_vocab: bool = False) -> Plan:
    """A plait Plan from a Galvatron strategy file (`galvatron_config_*.json`).

    Per-layer lists cover all layers of all kinds in model order (Galvatron's layer types one after
    another, see `layer_types`). One pipeline; stage k is blocks pp_division[k] on ranks
    [k*W/pp, (k+1)*W/pp) in ascending order; each block gets dp = W/pp/tp, tp, (use_sp: cp = that degree,
    Ulysses, instead of tp), zero from dp_types and default_dp_type, recompute full where checkpoint = 1;
    micro_batches = chunks, micro_batch_sequences = global_bsz / chunks; schedule 1f1b for pipedream_flush,
    gpipe for gpipe. Blocks of a stage that all share one strategy are stored as a single strategy.

    `precision`: bf16/fp16/fp32, default from the file name's `_bf16`-style token, else bf16.
    `sequence_parallel`: Galvatron was launched with `--sequence-parallel` (Megatron SP on every TP block).
    Where the file's vtp/vsp/embed_sdp differ from the first and last blocks' strategies (which is what a
    plait plan runs the embedding and head with) a GalvatronVocabWarning is issued, or with
    `strict_vocab` a PlaitError raised. Non-consecutive TP groups (tp_consecutive_flags 0 with
    1 < tp < devices of the stage) have no plait rank order and raise PlaitError.
    """
    path = Path(path)
    where = f"Galvatron config {str(path)!r}"
    cfg = _read_json(path, "Galvatron config")
    n, layers = model.layers, _layers_text(model)
    pp = _int_field(cfg, "pp_deg", where)
    tp_sizes = _int_list(cfg, "tp_sizes_enc", where, n, layers=layers)
    consec = _int_list(cfg, "tp_consecutive_flags", where, n, default=1, layers=layers)
    dp_types = _int_list(cfg, "dp_types_enc", where, n, layers=layers)
    use_sp = _int_list(cfg, "use_sp", where, n, default=0, layers=layers)
    ckpt = _int_list(cfg, "checkpoint", where, n, default=0, layers=layers)
    for key, values in (("tp_consecutive_flags", consec), ("dp_types_enc", dp_types), ("use_sp", use_sp),
                        ("checkpoint", ckpt)):
        _flags(values, key, where)
    global_bsz = _int_field(cfg, "global_bsz", where)
    chunks = _int_field(cfg, "chunks", where)
    vtp = _int_field(cfg, "vtp", where, default=1)
    vsp = _int_field(cfg, "vsp", where, default=0)
    embed_sdp = _int_field(cfg, "embed_sdp", where, default=0)

    world = cluster.world_size
    if pp < 1 or world % pp:
        raise PlaitError(f"{where}: pp_deg={pp} does not divide the {world} devices of {cluster.name}; "
                         "use the cluster the strategy was searched for")
    per_stage = world // pp
    if "pp_division" in cfg:
        division = _int_list(cfg, "pp_division", where, None)
    else:  # Galvatron's default: even, the remainder on the last stage
        division = [n // pp] * (pp - 1) + [n - n // pp * (pp - 1)]
    if len(division) != pp or sum(division) != n or min(division) < 1:
        raise PlaitError(f"{where}: pp_division {division} must give {pp} positive block counts adding up to "
                         f"{n}, the {layers} of {model.name}")

    dp_type = cfg.get("default_dp_type", "ddp")
    if dp_type not in _DP_TYPES:
        raise PlaitError(f"{where}: default_dp_type must be ddp, zero2 or zero3, got {dp_type!r}")
    pipeline_type = cfg.get("pipeline_type", "gpipe")
    if pipeline_type not in _SCHEDULES:
        raise PlaitError(f"{where}: pipeline_type must be pipedream_flush or gpipe, got {pipeline_type!r}")
    if precision is None:
        token = _PRECISION_TOKEN.search(path.name)
        precision = token.group(1) if token else "bf16"
    if precision not in GALVATRON_PRECISIONS:
        raise PlaitError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    if chunks < 1 or global_bsz < 1:
        raise PlaitError(f"{where}: global_bsz={global_bsz} and chunks={chunks} must be positive integers; fix the "
                         "file")
    if global_bsz % chunks:
        raise PlaitError(f"{where}: global_bsz={global_bsz} is not a multiple of chunks={chunks}; plait "
                         "micro-batches all have the same size")

    strategies: list[Strategy] = []
    for i in range(n):
        degree = tp_sizes[i]
        if degree < 1 or per_stage % degree:
            raise PlaitError(f"{where}: layer {i} has tp_size {degree}, which does not divide the {per_stage} "
                             "devices of a stage")
        if consec[i] == 0 and 1 < degree < per_stage:
            kind = "sequence-parallel" if use_sp[i] else "tensor-parallel"
            raise PlaitError(f"{where}: layer {i} uses non-consecutive {kind} groups (tp_consecutive_flags=0), "
                             "which plait's tp-fastest rank order cannot express; search with "
                             "--disable_tp_consec 1")
        tp, cp = (1, degree) if use_sp[i] else (degree, 1)
        dp = per_stage // degree
        # The default dp type shards nothing where the weights have no replica (dp x cp = 1): ZeRO-0.
        zero = 3 if dp_types[i] else _DP_TYPES[dp_type] if dp * cp > 1 else 0
        strategies.append(Strategy(
            dp=dp, tp=tp, cp=cp, cp_mode="ulysses", sp=sequence_parallel and tp > 1, zero=zero,
            recompute="full" if ckpt[i] else "none"))

    stages = []
    start = 0
    for k, count in enumerate(division):
        own = strategies[start:start + count]
        stages.append(Stage(layers=(start, start + count),
                            ranks=tuple(range(k * per_stage, (k + 1) * per_stage)),
                            strategies=(own[0],) if len(set(own)) == 1 else tuple(own)))
        start += count
    plan = Plan(model=model.name, seq_len=seq_len, global_batch=global_bsz,
                schedule=_SCHEDULES[pipeline_type], precision=precision,  # type: ignore[arg-type]
                pipelines=(Pipeline(stages=tuple(stages), micro_batches=chunks,
                                    micro_batch_sequences=global_bsz // chunks),))
    plan = plan.with_runtime_p2p()  # priced as plait's runtime runs it
    validate_plan(plan, model, cluster)
    vocab_tp, vocab_cp = (1, vtp) if vsp else (vtp, 1)
    note = _vocab_mismatch(plan, vocab_tp, vocab_cp, 3 if embed_sdp else _DP_TYPES[dp_type])
    if note:
        if strict_vocab:
            raise PlaitError(f"{where}: {note}; drop strict_vocab to accept that")
        warnings.warn(f"{where}: {note}", GalvatronVocabWarning, stacklevel=2)
    return plan


DEFAULT_DP_TYPES = ("ddp", "zero2")
"""Galvatron's default_dp_type choices (one for the whole model; per-layer SDP adds ZeRO-3): ZeRO-0 or 2."""


def strategy_problem(s: Strategy, sequence_parallel: bool) -> str | None:
    """What in one layer's strategy a Galvatron 2.4.0 strategy file cannot say (None: it can), for a run
    launched with (`sequence_parallel`) or without Galvatron's `--sequence-parallel` flag, which turns
    Megatron sequence parallelism on for every tensor-parallel layer."""
    if s.sp and not sequence_parallel:
        return ("uses Megatron sequence parallelism, which Galvatron turns on for every tensor-parallel layer "
                "with its --sequence-parallel launch flag (plait: --galvatron-sequence-parallel)")
    if sequence_parallel and s.tp > 1 and not s.sp:
        return (f"has tp{s.tp} without Megatron sequence parallelism, which Galvatron's --sequence-parallel "
                "launch flag turns on for every tensor-parallel layer")
    if s.cp > 1 and (s.tp > 1 or s.cp_mode != "ulysses"):
        return (f"combines cp{s.cp} ({s.cp_mode}) with tp{s.tp}; a Galvatron block uses either tensor "
                "parallelism or Ulysses sequence parallelism")
    if s.zero == 1:
        return "uses ZeRO-1, which Galvatron lacks (ddp, zero2 or zero3); use zero 0, 2 or 3"
    if s.recompute in ("selective", "attn_kept", "gemm_kept"):
        return f"uses {s.recompute} recomputation; Galvatron recomputes whole blocks or nothing"
    if s.recompute_modules:
        return (f"recomputes Megatron-LM's modules {'+'.join(s.recompute_modules)}; Galvatron recomputes whole "
                "blocks or nothing")
    if s.ep > 1 or s.etp or s.moe_comm != "alltoall":
        return "lays out experts (ep, etp, LSH-MoE), which Galvatron 2.4.0 has no model or strategy for"
    if s.shard:
        return f"shards ZeRO over groups of {s.shard} (HSDP), which Galvatron lacks"
    if s.swap or s.offload != "none":
        return "swaps activations or offloads the optimizer to host memory, which Galvatron lacks"
    return None


def uses_sequence_parallel(plan: Plan) -> bool:
    """Whether any layer of `plan` uses Megatron sequence parallelism (Galvatron: `--sequence-parallel`)."""
    return any(s.sp for pipe in plan.pipelines for stage in pipe.stages for s in stage.strategies)


def galvatron_problem(plan: Plan, model: ModelSpec, sequence_parallel: bool | None = None) -> str | None:
    """Why `plan` cannot be written as a Galvatron strategy file (None: it can). `sequence_parallel`: whether
    Galvatron runs with `--sequence-parallel` (None: as the plan says, `uses_sequence_parallel`). Layers
    whose weights have no replica (dp x cp = 1) shard nothing and fit either default_dp_type."""
    if sequence_parallel is None:
        sequence_parallel = uses_sequence_parallel(plan)
    if len(plan.pipelines) != 1:
        return (f"the plan has {len(plan.pipelines)} pipelines; Galvatron runs one pipeline whose stages hold "
                "their data parallelism")
    if plan.chunks != 1 or plan.schedule == "interleaved":
        return "Galvatron has no interleaved (virtual) pipeline; use schedule 1f1b or gpipe with chunks=1"
    if not plan.overlap_grad_reduce:
        return "Galvatron always overlaps gradient reduction with backward; set overlap_grad_reduce=true"
    if plan.precision not in GALVATRON_PRECISIONS:
        return (f"Galvatron trains in {', '.join(GALVATRON_PRECISIONS)} (--mixed_precision), not "
                f"{plan.precision}; plan with another --precision")
    pipe = plan.pipelines[0]
    pp = len(pipe.stages)
    per_stage = len(pipe.stages[0].ranks)
    if pipe.stages[-1].layers[1] != model.layers:
        return (f"the plan covers {pipe.stages[-1].layers[1]} layers but {model.name} has "
                f"{_layers_text(model)}; save it with the model it was made for")
    zeros = set()
    for k, stage in enumerate(pipe.stages):
        expected = tuple(range(k * per_stage, (k + 1) * per_stage))
        if stage.ranks != expected:
            return (f"stage {k} uses ranks {list(stage.ranks)}; Galvatron places stage {k} of {pp} equal stages "
                    f"on ranks {expected[0]}..{expected[-1]} in order")
        for layer in range(*stage.layers):
            s = stage.strategy(layer)
            if (problem := strategy_problem(s, sequence_parallel)) is not None:
                return f"layer {layer} {problem}"
            if s.dp * s.cp > 1:
                zeros.add(s.zero)
    if {0, 2} <= zeros:
        return ("the plan mixes ZeRO-0 and ZeRO-2 blocks; Galvatron's default_dp_type (ddp or zero2) is one for "
                "the whole model")
    return None


def _layer_expressible(s: Strategy, sequence_parallel: bool) -> bool:
    return strategy_problem(s, sequence_parallel) is None


def galvatron_limits(limits: SpaceLimits, sequence_parallel: bool, default_dp_type: str = "ddp") -> SpaceLimits:
    """`limits` narrowed to the layer strategies and schedules a Galvatron 2.4.0 strategy file can say, for a
    run with (`sequence_parallel`) or without `--sequence-parallel`: no virtual pipeline stages, ZeRO of the
    `default_dp_type` (ddp: 0, zero2: 2) or 3 (SDP), and `strategy_problem`'s per-layer rules."""
    if default_dp_type not in DEFAULT_DP_TYPES:
        raise PlaitError(f"default_dp_type must be one of {', '.join(DEFAULT_DP_TYPES)}, got {default_dp_type!r}")
    return replace(limits, zero_stages=(_DP_TYPES[default_dp_type], 3), interleaved=False,
                   allow=partial(_layer_expressible, sequence_parallel=sequence_parallel))


def expressible(model: ModelSpec, sequence_parallel: bool) -> Callable[[Plan], bool]:
    """The predicate a search restricted to plans Galvatron can run takes (`search(restrict=...)`)."""
    return lambda plan: galvatron_problem(plan, model, sequence_parallel) is None


def launch_flags(plan: Plan) -> tuple[str, ...]:
    """The Galvatron launch flags that run `plan` as plait prices it beside its strategy file (which records
    neither): the training precision, and Megatron sequence parallelism where the plan uses it."""
    flags = ("--mixed_precision", plan.precision)
    return (*flags, "--sequence-parallel") if uses_sequence_parallel(plan) else flags


def galvatron_config(plan: Plan, model: ModelSpec, *, strict_vocab: bool = False) -> dict[str, Any]:
    """The Galvatron strategy dict of `plan` (see save_galvatron_config for what can be represented)."""
    if (problem := galvatron_problem(plan, model)) is not None:
        raise PlaitError(problem)
    pipe = plan.pipelines[0]
    tp_sizes, use_sp, dp_types, ckpt = [], [], [], []
    zeros = set()
    for stage in pipe.stages:
        for layer in range(*stage.layers):
            s = stage.strategy(layer)
            tp_sizes.append(s.cp if s.cp > 1 else s.tp)
            use_sp.append(int(s.cp > 1))
            dp_types.append(int(s.zero == 3))
            ckpt.append(int(s.recompute == "full"))
            if s.dp * s.cp > 1:
                zeros.add(s.zero)
    default_dp_type = "zero2" if 2 in zeros else "ddp"
    first = pipe.stages[0].strategy(0)
    vtp, vsp = (first.cp, 1) if first.cp > 1 else (first.tp, 0)
    embed_sdp = int(first.zero == 3)
    note = _vocab_mismatch(plan, first.tp, first.cp, first.zero)
    if note:
        note = f"the last block's strategy cannot be given to the LM head: {note}"
        if strict_vocab:
            raise PlaitError(f"{note}; drop strict_vocab to accept that")
        warnings.warn(note, GalvatronVocabWarning, stacklevel=3)

    def enc(values: list[int]) -> str:
        return ",".join(map(str, values))

    # Key order and encoding as Galvatron's SearchEngine.save_results writes them.
    return {
        "pp_deg": len(pipe.stages),
        "tp_sizes_enc": enc(tp_sizes),
        "tp_consecutive_flags": enc([1] * len(tp_sizes)),
        "dp_types_enc": enc(dp_types),
        "use_sp": enc(use_sp),
        "checkpoint": enc(ckpt),
        "global_bsz": plan.global_batch,
        "chunks": pipe.micro_batches,
        "pp_division": enc([s.num_layers for s in pipe.stages]),
        "pipeline_type": "pipedream_flush" if plan.schedule == "1f1b" else "gpipe",
        "default_dp_type": default_dp_type,
        "vtp": vtp,
        "vsp": vsp,
        "embed_sdp": embed_sdp,
    }


def save_galvatron_config(plan: Plan, model: ModelSpec, path: str | Path, *,
                          strict_vocab: bool = False) -> None:
    """Write `plan` as a Galvatron strategy file (json.dump with indent 4, as Galvatron writes it).

    Representable (`galvatron_problem` says why not): one pipeline of stages with equal device counts on
    ascending contiguous ranks (stage k on ranks k*W/pp..), schedule 1f1b or gpipe without model chunks, per
    block tp, or Ulysses cp without tp, zero 0/2/3 (not 0 and 2 together: Galvatron's default_dp_type is
    global), recompute none or full, Megatron sp on every tp > 1 block or on none (Galvatron's
    --sequence-parallel launch flag, `launch_flags`), no experts, HSDP, swapping or offload, gradient
    reduction overlapped. The precision is not part of the file either (Galvatron's --mixed_precision).
    vtp/vsp/embed_sdp are taken from the first block; a last block with another layout gives a
    GalvatronVocabWarning (or, with `strict_vocab`, a PlaitError).
    """
    config = galvatron_config(plan, model, strict_vocab=strict_vocab)
    write_atomically(Path(path), json.dumps(config, indent=4))


# ==== profiles ======================================================================================

@dataclass(frozen=True)
class LayerTime:
    """Measured forward time of one Galvatron layer type on one GPU (no parallelism)."""

    forward_ms_per_sample: Mapping[tuple[int, int], float]
    """(batch size, sequence length) -> milliseconds of one block's forward per sequence (may be noisy or
    even negative at small batches: Galvatron takes it as a difference of two runs)."""
    other_ms_per_sample: Mapping[tuple[int, int], float]
    """(batch size, sequence length) -> milliseconds per sequence of everything but the blocks (embedding,
    head, loss)."""


@dataclass(frozen=True)
class LayerMemory:
    """Measured memory of one Galvatron layer type at one sequence length."""

    layer_type: int
    seq_len: int | None  # None: the file does not say
    sequence_parallel: bool  # measured with Megatron sequence parallelism (`_sp` keys)
    parameter_mib: float
    """MiB of one block's parameters at 4 bytes each, unsharded (Galvatron: model states / 4)."""
    activation_mib_per_sample: Mapping[int, float]
    """TP degree -> MiB of activations one block keeps per sequence on one device of its TP group."""
    checkpoint_activation_mib_per_sample: float | None
    """The same under full recomputation (the block input only), None if not profiled."""


@dataclass(frozen=True)
class OtherMemory:
    """Measured memory of everything but the blocks (embedding, head, loss) at one pipeline position."""

    position: str  # "whole" (other_memory_pp_off: one stage), "first" or "last" (pp_on: the edge stages)
    seq_len: int | None  # None: the file does not say
    sequence_parallel: bool  # `_sp` keys
    model_states_mib: Mapping[int, float]
    """Vocabulary-parallel degree -> MiB of the edges' model states on one device (old flat files: tp 1)."""
    activation_mib_per_sample: Mapping[int, float]
    """Vocabulary-parallel degree -> MiB per sequence of the peak beside the blocks' saved activations."""


@dataclass(frozen=True)
class HardwareProfile:
    """Galvatron's communication measurements on a cluster of `nodes` x `gpus_per_node` GPUs."""

    nodes: int
    gpus_per_node: int
    allreduce_busbw_gbps: Mapping[tuple[int, bool], float]
    """(group size, consecutive ranks) -> nccl-tests average all-reduce bus bandwidth, GB/s (1e9 B/s)."""
    p2p_busbw_gbps: Mapping[int, float]
    """Pipeline degree p -> send/recv bus bandwidth between ranks W/p apart, GB/s."""
    allreduce_ms: Mapping[tuple[int, int], float]
    """(group size, message MiB) -> milliseconds of an all-reduce over consecutive ranks (sp_time file)."""
    all2all_ms: Mapping[tuple[int, int], float]
    """(group size, message MiB) -> milliseconds of an all-to-all over consecutive ranks (sp_time file)."""


@dataclass(frozen=True)
class GalvatronCalibration:
    """Everything plait reads from one model's Galvatron profiles and one hardware profile directory."""

    gpu_name: str  # the GPU type the caller says the profiles were measured on
    precision: str | None  # from the profile file names (bf16, fp16, fp32)
    hidden: int | None  # from the profile file names (`hidden4096`), None if not there
    heads: int | None  # from the profile file names (`head32`)
    layer_times: tuple[LayerTime, ...]  # index = Galvatron layer type
    layer_memory: tuple[LayerMemory, ...]
    hardware: tuple[HardwareProfile, ...]
    overlap_coefficient: float | None  # slowdown (>= 1) of work that overlaps other work
    files: tuple[str, ...]  # the files read
    other_memory: tuple[OtherMemory, ...] = ()  # the memory profile's other_memory_* entries


_TIME_KEY = re.compile(r"^layertype_(\d+)(?:_bsz(\d+))?(?:_seq(\d+))?$")
_OTHER_KEY = re.compile(r"^layertype_other(?:_(\d+))?_bsz(\d+)(?:_seq(\d+))?$")
_RAW_TIME_KEY = re.compile(r"^layernum\[[\d,]+\]_bsz(\d+)$")
_MEMORY_KEY = re.compile(r"^layertype_(\d+)(_sp)?$")
_OTHER_MEMORY_KEY = re.compile(r"^other_memory_pp_(off|on_first|on_last)(_sp)?$")
_POSITIONS = {"off": "whole", "on_first": "first", "on_last": "last"}
_ALLREDUCE_KEY = re.compile(r"^allreduce_size_(\d+)_consec_([01])$")
_P2P_KEY = re.compile(r"^pp_size_(\d+)$")
_SP_TIME_KEY = re.compile(r"^(allreduce|all2all)_size_(\d+)_(\d+)MB_time$")
_HW_FILE = re.compile(r"^(allreduce_bandwidth|p2p_bandwidth|sp_time)_(\d+)nodes_(\d+)gpus_per_node\.json$")


def _number(value: Any, key: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise PlaitError(f"Galvatron profile {str(path)!r}: {key} must be a number, got {value!r}")
    return float(value)


def _name_int(pattern: str, name: str) -> int | None:
    m = re.search(pattern, name)
    return int(m.group(1)) if m else None


def _read_times(path: Path, file_seq: int | None) -> tuple[LayerTime, ...]:
    raw = _read_json(path, "Galvatron computation profile")
    forward: dict[int, dict[tuple[int, int], float]] = {}
    other: dict[int, dict[tuple[int, int], float]] = {}
    bare: dict[int, float] = {}
    raw_batches = {int(m.group(1)) for k in raw if (m := _RAW_TIME_KEY.match(k))}
    for key, value in raw.items():
        if m := _OTHER_KEY.match(key):
            seq = int(m.group(3)) if m.group(3) else file_seq
            if seq is not None:
                other.setdefault(int(m.group(1) or 0), {})[(int(m.group(2)), seq)] = _number(value, key, path)
        elif m := _TIME_KEY.match(key):
            layer_type = int(m.group(1))
            if m.group(2) is None:
                bare[layer_type] = _number(value, key, path)
                continue
            seq = int(m.group(3)) if m.group(3) else file_seq
            if seq is not None:
                forward.setdefault(layer_type, {})[(int(m.group(2)), seq)] = _number(value, key, path)
    # A bare `layertype_<i>` (old static profile) was measured at the one batch size of the raw runs.
    for layer_type, value in bare.items():
        if layer_type not in forward and file_seq is not None and len(raw_batches) == 1:
            forward[layer_type] = {(raw_batches.pop(), file_seq): value}
    if not forward:
        raise PlaitError(f"Galvatron computation profile {str(path)!r} has no layertype_<i>_bsz<b>_seq<s> "
                         "times (or the sequence length is neither in the keys, nor a seqlen<s> in the file "
                         "name, nor given as the sequence length)")
    types = range(max(forward) + 1)
    return tuple(LayerTime(forward.get(t, {}), other.get(t, {})) for t in types)


def _layer_memory(entry: Any, layer_type: int, seq: int | None, sp: bool, key: str, path: Path) -> LayerMemory:
    if not (isinstance(entry, dict) and "parameter_size" in entry and "tp_activation_per_bsz_dict" in entry):
        raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} lacks parameter_size or "
                         "tp_activation_per_bsz_dict")
    acts = entry["tp_activation_per_bsz_dict"]
    if not isinstance(acts, dict):
        raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key}.tp_activation_per_bsz_dict is not "
                         "an object")
    per_tp: dict[int, float] = {}
    for tp, value in acts.items():
        if tp == "checkpoint":
            continue
        if not str(tp).isdigit():
            raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} has activation key {tp!r}; "
                             "expected TP degrees and 'checkpoint'")
        per_tp[int(tp)] = _number(value, f"{key}.{tp}", path)
    ckpt = acts.get("checkpoint")
    return LayerMemory(layer_type, seq, sp, _number(entry["parameter_size"], f"{key}.parameter_size", path),
                       dict(sorted(per_tp.items())),
                       None if ckpt is None else _number(ckpt, f"{key}.checkpoint", path))


def _mib_by_tp(value: Any, key: str, path: Path) -> dict[int, float]:
    """{tp: MiB} of an other_memory term: one number (old files: tp 1) or an object keyed by TP degree."""
    if not isinstance(value, dict):
        return {1: _number(value, key, path)}
    out: dict[int, float] = {}
    for tp, v in value.items():
        if not str(tp).isdigit() or int(tp) < 1:
            raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} has key {tp!r}; expected TP degrees")
        out[int(tp)] = _number(v, f"{key}.{tp}", path)
    return dict(sorted(out.items()))


def _other_memory(entry: Any, position: str, seq: int | None, sp: bool, key: str, path: Path) -> OtherMemory:
    if not (isinstance(entry, dict) and "model_states" in entry and "activation" in entry):
        raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} lacks model_states or activation")
    return OtherMemory(position, seq, sp, _mib_by_tp(entry["model_states"], f"{key}.model_states", path),
                       _mib_by_tp(entry["activation"], f"{key}.activation", path))


def _read_memory(path: Path, file_seq: int | None) -> tuple[tuple[LayerMemory, ...], tuple[OtherMemory, ...]]:
    """The per-block entries (`layertype_<i>[_sp]`) and the other_memory_* entries of a memory profile, flat
    (one sequence length: the file name's) or keyed by sequence length (`[512,512]` for several layer types:
    the length is then not one number and stays None)."""
    raw = _read_json(path, "Galvatron memory profile")
    out: list[LayerMemory] = []
    others: list[OtherMemory] = []
    for key, value in raw.items():
        if m := _OTHER_MEMORY_KEY.match(key):
            position, sp = _POSITIONS[m.group(1)], bool(m.group(2))
            if not isinstance(value, dict):
                raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} is not an object")
            if "model_states" in value:
                others.append(_other_memory(value, position, file_seq, sp, key, path))
            else:
                others += [_other_memory(entry, position, int(seq) if str(seq).isdigit() else None, sp,
                                         f"{key}.{seq}", path) for seq, entry in value.items()]
            continue
        m = _MEMORY_KEY.match(key)
        if not m:
            continue  # the raw per-strategy runs, from which Galvatron's profiler derived the entries read
        layer_type, sp = int(m.group(1)), bool(m.group(2))
        if isinstance(value, dict) and "parameter_size" in value:
            out.append(_layer_memory(value, layer_type, file_seq, sp, key, path))
        elif isinstance(value, dict):
            for seq, entry in value.items():
                if not str(seq).isdigit():
                    raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} has key {seq!r}; expected "
                                     "sequence lengths")
                out.append(_layer_memory(entry, layer_type, int(seq), sp, f"{key}.{seq}", path))
        else:
            raise PlaitError(f"Galvatron memory profile {str(path)!r}: {key} is not an object")
    return (tuple(sorted(out, key=lambda x: (x.layer_type, x.sequence_parallel, x.seq_len or 0))),
            tuple(sorted(others, key=lambda x: (x.position, x.sequence_parallel, x.seq_len or 0))))


def _read_hardware(hardware_dir: Path) -> tuple[tuple[HardwareProfile, ...], float | None, list[str]]:
    if not hardware_dir.is_dir():
        raise PlaitError(f"Galvatron hardware directory {str(hardware_dir)!r} does not exist; give the "
                         "profile_hardware/hardware_configs directory")
    shapes: dict[tuple[int, int], dict[str, dict]] = {}
    files: list[str] = []
    for path in sorted(hardware_dir.iterdir()):
        m = _HW_FILE.match(path.name)
        if not m:
            continue
        kind, shape = m.group(1), (int(m.group(2)), int(m.group(3)))
        files.append(str(path))
        tables = shapes.setdefault(shape, {"allreduce": {}, "p2p": {}, "sp_allreduce": {}, "sp_all2all": {}})
        for key, value in _read_json(path, "Galvatron hardware profile").items():
            if kind == "allreduce_bandwidth" and (k := _ALLREDUCE_KEY.match(key)):
                tables["allreduce"][(int(k.group(1)), k.group(2) == "1")] = _number(value, key, path)
            elif kind == "p2p_bandwidth" and (k := _P2P_KEY.match(key)):
                tables["p2p"][int(k.group(1))] = _number(value, key, path)
            elif kind == "sp_time" and (k := _SP_TIME_KEY.match(key)):
                tables[f"sp_{k.group(1)}"][(int(k.group(2)), int(k.group(3)))] = _number(value, key, path)
    overlap = None
    overlap_path = hardware_dir / "overlap_coefficient.json"
    if overlap_path.exists():
        files.append(str(overlap_path))
        raw = _read_json(overlap_path, "Galvatron overlap coefficient")
        if "overlap_coe" not in raw:
            raise PlaitError(f"{str(overlap_path)!r} has no 'overlap_coe'")
        overlap = _number(raw["overlap_coe"], "overlap_coe", overlap_path)
        if overlap < 1.0:
            raise PlaitError(f"{str(overlap_path)!r}: overlap_coe {overlap} is below 1; it is a slowdown "
                             "factor")
    profiles = tuple(
        HardwareProfile(nodes, gpn, *(dict(sorted(t[k].items())) for k in ("allreduce", "p2p", "sp_allreduce",
                                                                           "sp_all2all")))
        for (nodes, gpn), t in sorted(shapes.items()))
    return profiles, overlap, files


def load_galvatron_profiles(model_dir: str | Path, hardware_dir: str | Path | None, gpu_name: str, *,
                            profile: str | None = None, seq_len: int | None = None) -> GalvatronCalibration:
    """Read Galvatron's model profiles and hardware profiles measured on GPUs of type `gpu_name`.

    `model_dir` is a Galvatron `models/<model>/configs` directory (or one computation_profiling_*.json file
    in it); `profile` picks the files `computation_profiling_<profile>.json` and
    `memory_profiling_<profile>.json` (e.g. `bf16_hidden4096_head32_seqlen2048`) when the directory holds
    several. The memory profile is optional. Times keyed without a sequence length (`layertype_<i>_bsz<b>`)
    were measured at the `seqlen<s>` of the file name, or, in files named as Galvatron 2.4's search reads
    them (`computation_profiling_bf16_llama-7b.json`), at `seq_len` (the run's sequence length).
    Every `layertype_<i>` of both files is read (`layer_times[i]`,
    `LayerMemory.layer_type`); `to_calibration` maps type i to the model's i-th layer kind (`layer_types`).
    `hardware_dir` is a `profile_hardware/hardware_configs` directory (None: no hardware profile).
    Galvatron's files do not record the GPU type: `gpu_name` is stored so that `to_calibration` can refuse a
    cluster of another GPU type.
    """
    if not gpu_name:
        raise PlaitError("give the GPU type the Galvatron profiles were measured on, e.g. A100-80GB")
    model_dir = Path(model_dir)
    if model_dir.is_file():
        name = model_dir.name
        if not (name.startswith("computation_profiling_") and name.endswith(".json")):
            raise PlaitError(f"{str(model_dir)!r} is not a computation_profiling_*.json file")
        profile = name[len("computation_profiling_"):-len(".json")]
        model_dir = model_dir.parent
    elif not model_dir.is_dir():
        raise PlaitError(f"Galvatron model profile directory {str(model_dir)!r} does not exist; give a "
                         "models/<model>/configs directory")
    found = sorted(p.name[len("computation_profiling_"):-len(".json")]
                   for p in model_dir.glob("computation_profiling_*.json"))
    if profile is None:
        if not found:
            raise PlaitError(f"{str(model_dir)!r} holds no computation_profiling_*.json; give the "
                             "models/<model>/configs directory Galvatron's profiler wrote to")
        if len(found) > 1:
            raise PlaitError(f"{str(model_dir)!r} holds {len(found)} computation profiles ({', '.join(found)}); "
                             "give one file instead of the directory, e.g. "
                             f"GPU:{model_dir / ('computation_profiling_' + found[0] + '.json')}")
        profile = found[0]
    elif profile not in found:
        raise PlaitError(f"{str(model_dir)!r} has no computation_profiling_{profile}.json; it has: "
                         f"{', '.join(found) or 'none'}")
    time_path = model_dir / f"computation_profiling_{profile}.json"
    memory_path = model_dir / f"memory_profiling_{profile}.json"
    file_seq = _name_int(r"seqlen(\d+)", profile) or seq_len
    times = _read_times(time_path, file_seq)
    memory, other_memory = _read_memory(memory_path, file_seq) if memory_path.exists() else ((), ())
    files = [str(time_path)] + ([str(memory_path)] if memory_path.exists() else [])
    hardware: tuple[HardwareProfile, ...] = ()
    overlap = None
    if hardware_dir is not None:
        hardware, overlap, hw_files = _read_hardware(Path(hardware_dir))
        files += hw_files
    token = re.match(r"^(bf16|fp16|fp32)(?:_|$)", profile)
    return GalvatronCalibration(
        gpu_name=gpu_name, precision=token.group(1) if token else None,
        hidden=_name_int(r"hidden(\d+)", profile), heads=_name_int(r"head(\d+)", profile),
        layer_times=times, layer_memory=memory, hardware=hardware, overlap_coefficient=overlap,
        files=tuple(files), other_memory=other_memory)


# ==== calibration ===================================================================================

GEMM_EFFICIENCY_RANGE = (0.05, 0.95)
LINK_EFFICIENCY_RANGE = (0.05, 1.0)
PARAMETER_TOLERANCE = 0.02
"""Largest relative difference between a profile's parameter size and the model's before the profile is
taken to belong to another model. Galvatron measures a block's parameters to well within this (0.15% for
llama-7b, 0.1% for a 13B GPT block); block shapes that differ only in grouped-query attention or the ffn
size differ by more (llama3-8b's block is 7.6% larger than llama-7b's)."""


def _clip(value: float, bounds: tuple[float, float]) -> float:
    return min(max(value, bounds[0]), bounds[1])


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _type_name(types: tuple[LayerType, ...], i: int) -> str:
    """`layertype_1 (cross_decoder)`, or plain `block` for a model of one kind."""
    return f"layertype_{i} ({types[i][0][0].kind})" if len(types) > 1 else "block"


def _mean_params(layer_type: LayerType) -> float:
    """Parameters of one layer of a type (the mean over its layers)."""
    return sum(b.params * n for b, n in layer_type) / sum(n for _, n in layer_type)


def _check_model(galv: GalvatronCalibration, model: ModelSpec) -> None:
    types = layer_types(model)
    profiled = max(len(galv.layer_times), 1 + max((m.layer_type for m in galv.layer_memory), default=-1))
    if profiled != len(types):
        kinds = ", ".join(model.kind_counts())
        raise PlaitError(f"the Galvatron profile has {_count(profiled, 'layer type')} but {model.name} has "
                         f"{_count(len(types), 'layer kind')} ({kinds}); layertype_<i> is the model's i-th kind, "
                         "so use a profile of this model with one layer type per kind")
    for name, theirs, ours in (("hidden", galv.hidden, model.hidden), ("heads", galv.heads, model.heads)):
        if theirs is not None and theirs != ours:
            raise PlaitError(f"the Galvatron profile was measured with {name}={theirs} but {model.name} has "
                             f"{name}={ours}; use the profile of this model")
    for mem in galv.layer_memory:
        params = _mean_params(types[mem.layer_type]) * 4 / MIB
        if abs(mem.parameter_mib - params) > PARAMETER_TOLERANCE * params:
            what = _type_name(types, mem.layer_type)
            raise PlaitError(f"the Galvatron profile's {what} has {mem.parameter_mib:.1f} MiB of fp32 "
                             f"parameters but a {what} of {model.name} has {params:.1f} MiB; use the profile of "
                             "this model")


def _block_forward_s(efficiency: float, layer_type: LayerType, model: ModelSpec, cluster: Cluster,
                     base: Calibration, precision: str, batch: int, seq: int) -> float:
    """plait's forward seconds of one layer of a Galvatron layer type on one GPU (no parallelism) at a given
    gemm_efficiency: the mean over the type's layers, as Galvatron's per-layer difference measures it."""
    ctx = BlockContext(model, cluster, replace(base, gemm_efficiency=efficiency), PRECISIONS[precision], seq,
                       batch, SINGLE, SINGLE, SINGLE)
    total = sum(price(block, Strategy(), ctx).time.forward * n for block, n in layer_type)
    return total / sum(n for _, n in layer_type)


def _fit_point(layer_type: LayerType, model: ModelSpec, cluster: Cluster, base: Calibration, precision: str,
               batch: int, seq: int, target_s: float) -> float:
    """The gemm_efficiency (within GEMM_EFFICIENCY_RANGE) at which one layer's forward takes `target_s`."""
    def forward(efficiency: float) -> float:
        return _block_forward_s(efficiency, layer_type, model, cluster, base, precision, batch, seq)

    lo, hi = GEMM_EFFICIENCY_RANGE
    if forward(hi) >= target_s:
        return hi
    if forward(lo) <= target_s:
        return lo
    for _ in range(30):  # forward time falls as the efficiency rises
        mid = 0.5 * (lo + hi)
        if forward(mid) > target_s:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _fit_gemm_efficiency(galv: GalvatronCalibration, model: ModelSpec, cluster: Cluster,
                         base: Calibration) -> tuple[float, str] | None:
    """The gemm_efficiency that makes plait's forward time of one layer (tp=1, one GPU) equal each measured
    point of each layer type (priced with the type's own layers), the median over the points."""
    precision = galv.precision or "bf16"
    types = layer_types(model)
    fits, skipped = [], 0
    for layer_type, measured in zip(types, galv.layer_times, strict=True):
        points = sorted((k, v) for k, v in measured.forward_ms_per_sample.items() if v > 0)
        skipped += len(measured.forward_ms_per_sample) - len(points)
        fits += [_fit_point(layer_type, model, cluster, base, precision, batch, seq, ms * 1e-3 * batch)
                 for (batch, seq), ms in points]
    if not fits:
        return None
    over = (f"(layer type, batch, seq) points of {len(types)} layer types" if len(types) > 1
            else "(batch, seq) points")
    why = (f"median over {len(fits)} {over} of the value that makes plait's block forward time equal "
           "Galvatron's measured one (other constants from base"
           + (f"; {skipped} non-positive points skipped)" if skipped else ")"))
    return statistics.median(fits), why


def _multi_node_hardware(galv: GalvatronCalibration, cluster: Cluster) -> HardwareProfile | None:
    """The multi-node profile with the cluster's GPUs per node: the cluster's own shape, else the most nodes."""
    same = [h for h in galv.hardware if h.gpus_per_node == cluster.gpus_per_node and h.nodes > 1]
    exact = [h for h in same if h.nodes == cluster.nodes]
    if exact:
        return exact[0]
    return max(same, key=lambda h: h.nodes) if same else None


def _intra_busbw(galv: GalvatronCalibration, cluster: Cluster) -> tuple[float, str] | None:
    """Bus bandwidth (B/s) of an all-reduce over one whole node, and where it comes from. Every profile with
    the cluster's GPUs per node measures the same node; size-resolved times (sp_time) are preferred to the
    size-averaged bandwidth, and the profile of the cluster's own shape to others."""
    g = cluster.gpus_per_node
    if g < 2:
        return None
    same = sorted((h for h in galv.hardware if h.gpus_per_node == g),
                  key=lambda h: (h.nodes != cluster.nodes, h.nodes))
    for hw in same:
        sizes = sorted((mib, ms) for (n, mib), ms in hw.allreduce_ms.items() if n == g)
        if len(sizes) < 2:
            continue
        # Least squares of time = a + bytes * 2 (g-1)/g / busbw, plait's all-reduce formula.
        xs = [mib * MIB for mib, _ in sizes]
        ys = [ms * 1e-3 for _, ms in sizes]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        if slope > 0:
            return 2 * (g - 1) / g / slope, (f"slope of all-reduce time over {g} GPUs against message size "
                                             f"({sizes[0][0]}-{sizes[-1][0]} MiB, sp_time of the "
                                             f"{hw.nodes}x{g} hardware profile)")
    for hw in same:
        if (g, True) in hw.allreduce_busbw_gbps:
            return hw.allreduce_busbw_gbps[(g, True)] * GB, (
                f"average bus bandwidth of all-reduce over {g} GPUs (16-512 MiB, {hw.nodes}x{g} hardware "
                "profile; a lower bound)")
    return None


def same_gpu(given: str, cluster_gpu: str) -> bool:
    """Whether the GPU type `given` names `cluster_gpu`, in full or without its memory size (A100 for
    A100-80GB), in any case."""
    given, cluster_gpu = given.upper(), cluster_gpu.upper()
    return given in (cluster_gpu, cluster_gpu.split("-")[0])


def _derive(galv: GalvatronCalibration, model: ModelSpec, cluster: Cluster,
            base: Calibration) -> dict[str, tuple[float | None, str]]:
    if not same_gpu(galv.gpu_name, cluster.gpu.name):
        raise PlaitError(f"the Galvatron profiles were measured on {galv.gpu_name} but cluster {cluster.name} has "
                         f"{cluster.gpu.name} GPUs; profile that GPU type or use a {galv.gpu_name} cluster")
    _check_model(galv, model)
    out: dict[str, tuple[float | None, str]] = {}

    gemm = _fit_gemm_efficiency(galv, model, cluster, base)
    out["gemm_efficiency"] = gemm if gemm else (None, "kept: no positive forward time in the profile")

    intra = _intra_busbw(galv, cluster)
    if intra:
        busbw, source = intra
        why = (f"{busbw / GB:.1f} GB/s measured bus bandwidth / {cluster.intra.bandwidth / GB:.0f} GB/s NVLink "
               f"of {cluster.name}: {source}")
        out["nvlink_efficiency"] = (_clip(busbw / cluster.intra.bandwidth, LINK_EFFICIENCY_RANGE), why)
    else:
        why = f"kept: no in-node all-reduce measurement for {cluster.gpus_per_node} GPUs per node"
        out["nvlink_efficiency"] = (None, why)

    hw = _multi_node_hardware(galv, cluster)
    key = (hw.nodes * hw.gpus_per_node, True) if hw else None
    if hw and key in hw.allreduce_busbw_gbps:
        measured = hw.allreduce_busbw_gbps[key] * GB
        nvlink = out["nvlink_efficiency"][0] or base.nvlink_efficiency
        nic_limit = hw.gpus_per_node * cluster.inter.bandwidth
        if measured < cluster.intra.bandwidth * nvlink:  # plait: min(NVLink, per_node x NIC); NIC-bound here
            why = (f"{measured / GB:.1f} GB/s average bus bandwidth of all-reduce over all {key[0]} GPUs of "
                   "the "
                   f"{hw.nodes}x{hw.gpus_per_node} hardware profile / ({hw.gpus_per_node} x "
                   f"{cluster.inter.bandwidth / GB:.0f} GB/s NICs)")
            out["network_efficiency"] = (_clip(measured / nic_limit, LINK_EFFICIENCY_RANGE), why)
        else:
            why = "kept: the multi-node all-reduce is NVLink-bound in plait's model"
            out["network_efficiency"] = (None, why)
    else:
        why = f"kept: no multi-node all-reduce measurement with {cluster.gpus_per_node} GPUs per node"
        out["network_efficiency"] = (None, why)

    if galv.overlap_coefficient is not None:
        c = galv.overlap_coefficient
        why = f"1 / overlap_coe ({c:.4f}): work that overlaps other work runs c times slower"
        out["overlap_efficiency"] = (_clip(1.0 / c, LINK_EFFICIENCY_RANGE), why)
    else:
        out["overlap_efficiency"] = (None, "kept: no overlap_coefficient.json")
    return out


def measured_memory(galv: GalvatronCalibration, model: ModelSpec) -> tuple[MeasuredMemory | None, str]:
    """The memory terms of Galvatron's memory profile in plait's units (cost/measured_memory.py), and what
    was read; None where the profile has no entry without sequence parallelism at a known sequence length.

    Per layer type (plait's layer kind, `layer_types`), at the profile's longest sequence length: model-state
    bytes per parameter = 4 x parameter_size MiB over plait's parameters of the block; activation bytes per
    token = tp_activation_per_bsz_dict[tp] MiB per sequence / sequence length, and its `checkpoint` entry for
    full recomputation at every tp (the block input, replicated over the TP group). Edges: other_memory_pp_off
    (one stage), _pp_on_first and _pp_on_last, activation MiB per sequence by vocabulary-parallel degree /
    sequence length. Entries measured with sequence parallelism (`_sp`) are not read: plait prices those
    layouts analytically. The model must match the profile (`_check_model`)."""
    types = layer_types(model)
    states: dict[str, float] = {}
    acts: dict[tuple[str, int, str], float] = {}
    read = []
    for mem in sorted((m for m in galv.layer_memory if not m.sequence_parallel and m.seq_len),
                      key=lambda m: m.seq_len or 0):  # the longest length last, so it wins
        kind, seq = types[mem.layer_type][0][0].kind, mem.seq_len or 1
        states[kind] = 4 * mem.parameter_mib * MIB / _mean_params(types[mem.layer_type])
        for tp, mib in mem.activation_mib_per_sample.items():
            acts[(kind, tp, "none")] = mib * MIB / seq
            if mem.checkpoint_activation_mib_per_sample is not None:
                acts[(kind, tp, "full")] = mem.checkpoint_activation_mib_per_sample * MIB / seq
        read.append(f"layertype_{mem.layer_type} at {seq}")
    if not states:
        return None, "kept: no memory profile without sequence parallelism at a known sequence length"
    edges = {o.position: EdgeMemory(o.model_states_mib.get(1, 0.0) * MIB,
                                    {tp: mib * MIB / o.seq_len for tp, mib in o.activation_mib_per_sample.items()})
             for o in sorted(galv.other_memory, key=lambda o: o.seq_len or 0)
             if not o.sequence_parallel and o.seq_len}
    kinds = ", ".join(f"{k} {v:.2f} B/param" for k, v in states.items())
    why = (f"from the memory profile ({', '.join(read)} tokens; edges: {', '.join(edges) or 'none'}): model "
           f"states {kinds}; activations per token by tp")
    return MeasuredMemory(states, acts, edges), why


def to_calibration(galv: GalvatronCalibration, model: ModelSpec, cluster: Cluster,
                   base: Calibration) -> Calibration:
    """plait calibration constants derived from Galvatron profiles; constants they say nothing about stay
    as in `base`.

    * gemm_efficiency: for every measured (batch, seq) forward time of one block of every layer type, the
      value that makes plait's own forward time of that block (tp=1, one GPU, at the GPU's peak for the
      profile's precision) equal it; the median of these, within (0.05, 0.95). Layer type i is priced as
      the model's i-th layer kind (`layer_types`; the mean over that kind's layers), and the profile must
      have as many layer types as the model has kinds. It absorbs every error of plait's attention and
      elementwise terms, which keep their base constants, so `model` must describe the profiled block
      (attention kind, dropout, MLP). The peak is that of the profile's precision (bf16 if not named).
    * nvlink_efficiency: all-reduce bus bandwidth over one whole node / the cluster's NVLink bandwidth. The
      bus bandwidth is the slope of all-reduce time against message size from sp_time (plait's formula
      keeps latency apart), else nccl-tests' size-averaged bus bandwidth (a lower bound).
    * network_efficiency: size-averaged all-reduce bus bandwidth over all GPUs of a multi-node profile /
      (GPUs per node x the cluster's per-GPU NIC bandwidth), plait's inter-node bus bandwidth.
    * overlap_efficiency = 1 / overlap_coe. Galvatron runs overlapped work c times slower; plait hides
      comm up to efficiency x compute. The two agree exactly when communication is as long as compute,
      under Galvatron's newer model (only compute slowed; exposed = comm (1 - 1/c)); its older layer model
      (both slowed) would give 2 - c, less than (c - 1)^2 apart.

    * memory: the memory profile's measured terms (`measured_memory`): a block's saved activations per
      token by tp and recompute, model-state bytes per parameter, the embedding's and head's transients.

    Not mapped: p2p bandwidth (plait prices p2p with the same link
    efficiencies), all-to-all times, latencies. Raises PlaitError when the cluster's GPU type is not the
    one the profiles were measured on, or the profile is of another model shape.
    """
    values = {k: v for k, (v, _) in _derive(galv, model, cluster, base).items() if v is not None}
    return replace(base, **values, memory=measured_memory(galv, model)[0])


def explain_calibration(galv: GalvatronCalibration, model: ModelSpec, cluster: Cluster,
                        base: Calibration) -> dict[str, str]:
    """For each constant to_calibration considers: the value it sets (or that it keeps base) and why."""
    out = {k: (f"{v:.3f}: {why}" if v is not None else why)
           for k, (v, why) in _derive(galv, model, cluster, base).items()}
    return out | {"memory": measured_memory(galv, model)[1]}
