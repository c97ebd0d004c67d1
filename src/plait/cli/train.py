"""`plait train`: train with a plan on this machine's ranks (through torchrun), or inside a torchrun job."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from plait.cli.common import (ModelOpt, PlanOpt, SeqLenOpt, StrategyOpt, app, one_line_errors, optional_output,
                              read_plan)
from plait.cli.multinode import (NnodesOpt, NodeRankOpt, PartitionOpt, RdzvEndpointOpt, SlurmOpt, TimeLimitOpt,
                                 write_sbatch)
from plait.errors import PlaitError
from plait.io import check_writable_dir
from plait.plan import Plan, uniform_plan, validate_plan
from plait.runtime.nodes import Nodes, check_world, node_notes, parse_nodes, torchrun_args
from plait.spec.model import ModelSpec, load_model

DataOpt = Annotated[Path | None, typer.Option(
    "--data", help="text file (byte-level), .bin/.npy token file, or dataset (.jsonl/.parquet files, a "
    "save_to_disk directory); default synthetic")]
TokenizerOpt = Annotated[Path | None, typer.Option(
    "--tokenizer", help="--data dataset: a local tokenizer directory (tokenizer.json)")]
TextFieldOpt = Annotated[str, typer.Option("--text-field", help="--data dataset: the column holding the text")]
DataDtypeOpt = Annotated[str | None, typer.Option(
    "--data-dtype", help="--data .bin: uint16 | uint32 | ... (default: from the name, else uint16)")]
DataCacheOpt = Annotated[Path | None, typer.Option(
    "--data-cache", help="where tokenized datasets are cached (default ~/.cache/plait/tokens)")]
CheckpointDirOpt = Annotated[Path | None, typer.Option(
    "--checkpoint-dir", help="save (DCP) here and resume from the newest readable checkpoint in it")]
NvmeDirOpt = Annotated[Path | None, typer.Option(
    "--nvme-dir", help="offload=nvme: where each rank keeps its optimizer state files (default: a temp dir)")]
ResumeFromOpt = Annotated[Path | None, typer.Option(
    "--resume-from", help="start from this checkpoint (a step-N directory) instead of the newest")]
TimeoutOpt = Annotated[float, typer.Option(
    "--timeout", help="seconds a rank waits in a collective before the job fails")]
HfCheckpointOpt = Annotated[Path | None, typer.Option(
    "--hf-checkpoint", help="start from Hugging Face safetensors weights in this directory")]
AdaptiveOpt = Annotated[bool, typer.Option(
    "--adaptive", help="detect straggling ranks and re-plan around them while training")]
InjectSlowOpt = Annotated[str | None, typer.Option(
    "--inject-slow", help="simulated stragglers RANK:FACTOR@STEP[,...] (FACTOR 1: recovered)")]
SwitchViaOpt = Annotated[str, typer.Option(
    "--switch-via", help="--adaptive: how a plan switch moves state: network (old to new owners) | dcp (save, load)")]
ReplanDegreesOpt = Annotated[str, typer.Option(
    "--replan-degrees", help="--adaptive: any (re-plans may change tp and pp degrees) | keep (the current "
    "degrees; shrunk tp units, data, layers and devices still move)")]
ReplanProfileOpt = Annotated[Path | None, typer.Option(
    "--profile", help="a `plait profile` file the re-planner prices plans with")]
VarlenOpt = Annotated[str | None, typer.Option(
    "--varlen", help="variable-length documents, layout per step: flexsp | bytescale | static")]
LengthsOpt = Annotated[Path | None, typer.Option(
    "--lengths", help="--varlen: document lengths to draw from (default: 10k Wikipedia lengths)")]
CpModeOpt = Annotated[str, typer.Option(
    "--cp-mode", help="--varlen flexsp/static: ulysses | ring (how a group splits a row)")]
VarlenStatesOpt = Annotated[str, typer.Option(
    "--varlen-states", help="--varlen: model states sharded over all ranks (FSDP2) | replicated")]
OffloadAboveOpt = Annotated[int, typer.Option(
    "--offload-above", help="--varlen: documents of at least this many tokens swap activations to host (0: none)")]
VarlenStagesOpt = Annotated[int, typer.Option(
    "--varlen-stages", help="--varlen: pipeline stages, each running the step's sequence-parallel groups")]


TasksOpt = Annotated[Path | None, typer.Option(
    "--tasks", help="train a task file's tasks in Spindle's waves (see `plait multitask`) instead of --model")]
NprocOpt = Annotated[int | None, typer.Option(
    "--nproc", "--gpus-per-node", help="ranks to launch on each node (default: the plan's)")]
StepsOpt = Annotated[int, typer.Option("--steps", help="optimizer steps")]
GlobalBatchOpt = Annotated[int | None, typer.Option("--global-batch", "-b", help="sequences per step")]
SeedOpt = Annotated[int, typer.Option("--seed")]
LrOpt = Annotated[float, typer.Option("--lr", help="peak learning rate")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="fp32 | bf16 (autocast over fp32 weights) | bf16-pure")]
MetricsOutOpt = Annotated[str | None, typer.Option("--metrics-out", help="JSON lines, one per step")]
CheckpointEveryOpt = Annotated[int, typer.Option("--checkpoint-every", help="steps between checkpoints")]
MaxRestartsOpt = Annotated[int, typer.Option("--max-restarts", help="torchrun restarts after a failure")]
CapacityOpt = Annotated[int, typer.Option("--capacity", help="--varlen: tokens a rank holds at once")]
VarlenSpOpt = Annotated[int | None, typer.Option("--sp", help="--varlen static: the sequence-parallel degree")]


@app.command(name="train")
def train_cmd(
    ctx: typer.Context, model: ModelOpt = "", tasks: TasksOpt = None, plan: PlanOpt = None, strategy: StrategyOpt = None,
    nproc: NprocOpt = None, nnodes: NnodesOpt = 1, node_rank: NodeRankOpt = 0, rdzv_endpoint: RdzvEndpointOpt = None,
    slurm: SlurmOpt = None, partition: PartitionOpt = None, time_limit: TimeLimitOpt = "01:00:00",
    steps: StepsOpt = 10, seq_len: SeqLenOpt = None, global_batch: GlobalBatchOpt = None, seed: SeedOpt = 0,
    lr: LrOpt = 3e-4, dtype: DtypeOpt = "fp32", data: DataOpt = None, metrics_out: MetricsOutOpt = None,
    checkpoint_dir: CheckpointDirOpt = None, checkpoint_every: CheckpointEveryOpt = 0,
    resume_from: ResumeFromOpt = None, timeout: TimeoutOpt = 300.0, max_restarts: MaxRestartsOpt = 0,
    hf_checkpoint: HfCheckpointOpt = None, adaptive: AdaptiveOpt = False, inject_slow: InjectSlowOpt = None,
    profile: ReplanProfileOpt = None, switch_via: SwitchViaOpt = "network",
    replan_degrees: ReplanDegreesOpt = "any",
    varlen: VarlenOpt = None, lengths: LengthsOpt = None, capacity: CapacityOpt = 1024, sp: VarlenSpOpt = None,
    cp_mode: CpModeOpt = "ulysses", varlen_states: VarlenStatesOpt = "sharded",
    offload_above: OffloadAboveOpt = 0, varlen_stages: VarlenStagesOpt = 1, tokenizer: TokenizerOpt = None,
    text_field: TextFieldOpt = "text", data_dtype: DataDtypeOpt = None, data_cache: DataCacheOpt = None,
    nvme_dir: NvmeDirOpt = None,
) -> None:
    """Train with a plan on this machine's ranks (launches torchrun), or inside an existing torchrun job.
    With --varlen, train on variable-length documents whose parallel layout is planned every step."""
    from plait.runtime import preflight
    from plait.runtime.data import prepare_data

    if tasks is not None:
        _train_tasks(tasks, nproc, steps, seed, lr, metrics_out, timeout, {
            "--model": model, "--plan": plan, "--strategy": strategy, "--data": data, "--varlen": varlen,
            "--nnodes": nnodes > 1, "--slurm": slurm, "--adaptive": adaptive, "--hf-checkpoint": hf_checkpoint,
            "--global-batch": global_batch, "--seq-len": seq_len, "--dtype": dtype != "fp32"},
            {"checkpoint_dir": checkpoint_dir, "checkpoint_every": checkpoint_every, "resume_from": resume_from})
    with one_line_errors():
        if not model:
            raise PlaitError("give --model (a preset, config.json or spec), or --tasks FILE to train a task file")
        m = load_model(model)
        source, data_dtype = prepare_data(str(data) if data else None, m.vocab, str(tokenizer) if tokenizer else None,
                                          text_field, data_dtype, str(data_cache) if data_cache else None)
        data = Path(source) if source else None
        preflight.check_numbers(lr=lr, seed=seed, timeout_s=timeout)
        metrics_file = optional_output(metrics_out, "metrics.jsonl", "--metrics-out")
        preflight.check_seq_len(seq_len, m)
        inside, world, nodes = _job(nproc, nnodes, node_rank, rdzv_endpoint, slurm, plan)
        _check_restarts(m, checkpoint_dir, checkpoint_every, resume_from, max_restarts)
        if varlen is not None:
            cfg, world = _varlen_config(m, model, varlen, world or 1, steps, global_batch, seed, lr, dtype, data,
                                        metrics_file, lengths, capacity, sp, cp_mode, varlen_states, offload_above,
                                        plan or strategy, varlen_stages,
                                        hf_checkpoint or adaptive or inject_slow or slurm)
            cfg = replace(cfg, timeout_s=timeout, data_dtype=data_dtype, checkpoint_every=checkpoint_every,
                          checkpoint_dir=_text(checkpoint_dir), resume_from=_text(resume_from))
            _launch(cfg, world, inside, max_restarts, m, nodes)
            return
        p, world = _train_plan(plan, strategy, m, world, steps, seq_len, global_batch)
        if _check_nodes(ctx, p, nodes, world, checkpoint_dir, slurm, partition, time_limit):
            return
        cfg = _train_config(p, m, model, world, steps=steps, seed=seed, lr=lr, dtype=dtype, data=data,
                            metrics_file=metrics_file, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                            timeout=timeout, resume_from=resume_from, hf_checkpoint=hf_checkpoint, adaptive=adaptive,
                            inject_slow=inject_slow, profile=profile, switch_via=switch_via,
                            replan_degrees=replan_degrees)
        cfg = replace(cfg, data_dtype=data_dtype, nvme_dir=_nvme_dir(nvme_dir))
    _launch(cfg, world, inside, max_restarts, m, nodes)


def _text(path: Path | None) -> str | None:
    """A path option as text for a config (None stays None)."""
    return str(path) if path else None


def _nvme_dir(path: Path | None) -> str | None:
    """The checked `--nvme-dir` (a writable directory), or None."""
    if path is None:
        return None
    check_writable_dir(path, "--nvme-dir")
    return str(path)


def _train_tasks(tasks: Path, nproc: int | None, steps: int, seed: int, lr: float, metrics_out: Path | None,
                 timeout: float, refused: dict, checkpoints: dict) -> None:
    """`plait train --tasks`: plan the task file's waves for the ranks and run them (`refused`: the options
    that do not apply, by flag; `checkpoints`: checkpoint_dir, checkpoint_every, resume_from)."""
    from plait.cli.train_tasks import run_tasks, tasks_config

    with one_line_errors():
        metrics_file = optional_output(metrics_out, "metrics.jsonl", "--metrics-out")
        inside, world = _torchrun_world(nproc)
        cfg, world = tasks_config(tasks, world, steps, seed, lr, metrics_file, timeout, refused, **checkpoints)
    raise typer.Exit(run_tasks(cfg, world, inside))


def _torchrun_world(nproc: int | None) -> tuple[bool, int | None]:
    """(whether this process already runs inside a torchrun job, its ranks: the job's or --nproc)."""
    import os

    inside = "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)
    return inside, int(os.environ["WORLD_SIZE"]) if inside else nproc


def _job(nproc: int | None, nnodes: int, node_rank: int, endpoint: str | None,
         slurm: str | None, plan: Path | None) -> tuple[bool, int | None, Nodes]:
    """(inside a torchrun job already, its ranks: the job's or --nnodes x --nproc, the nodes to launch on)."""
    inside, world = _torchrun_world(nproc)
    if inside and (nnodes > 1 or slurm):
        raise PlaitError("this already runs inside a torchrun job; drop --nnodes/--slurm or run plait train alone")
    if nnodes > 1 and nproc is None and plan is None:
        raise PlaitError(f"--nnodes {nnodes} without --plan needs --nproc (or --gpus-per-node), the ranks of each "
                         "node")
    nodes = Nodes(nnodes) if slurm and nnodes >= 1 else parse_nodes(nnodes, node_rank, endpoint)
    return inside, world * nnodes if world and not inside else world, nodes


def _check_nodes(ctx: typer.Context, p: Plan, nodes: Nodes, world: int, checkpoint_dir: Path | None, slurm: str | None,
                 partition: str | None, time_limit: str) -> bool:
    """Check that the plan fills the nodes (and print what to know about them); with --slurm write the
    sbatch script instead of training. True when the script was written."""
    from plait.cli.common import err

    nproc = check_world(p, nodes, world)
    if slurm is not None:
        path = write_sbatch(slurm, ctx, nodes.count, nproc, partition, time_limit)
        err.print(f"wrote {path}: submit it with `sbatch {path}`", highlight=False, soft_wrap=True)
        return True
    for line in node_notes(p, nodes, nproc, checkpoint_dir):
        err.print(f"[yellow]note:[/] {line}", highlight=False, soft_wrap=True)
    return False


def _train_plan(plan: Path | None, strategy: str | None, m: ModelSpec, world: int | None, steps: int,
                seq_len: int | None, global_batch: int | None) -> tuple[Plan, int]:
    """The plan that --plan or --strategy gives on this machine's ranks, checked to run, and its ranks."""
    from plait.runtime import preflight
    from plait.runtime.placement import check_executable
    from plait.spec.cluster import local_ranks

    if (plan is None) == (strategy is None):
        raise PlaitError("give exactly one of --plan FILE or --strategy \"dp=..,tp=..\"")
    if steps <= 0 or (world is not None and world <= 0):
        raise PlaitError("--steps and --nproc must be positive")
    if plan is not None:
        p = read_plan(plan, m, local_ranks(world or 1), seq_len)
        world = world or p.ranks[-1] + 1
    else:
        world = world or 1
        text = strategy or ""
        if global_batch is not None and "gbs=" not in text:
            text += f",gbs={global_batch}"
        p = uniform_plan(text, m, local_ranks(world), seq_len or min(m.max_seq_len, 256))
    if global_batch is not None and global_batch != p.global_batch:
        raise PlaitError(f"--global-batch {global_batch} differs from the plan's {p.global_batch}")
    preflight.check_seq_len(p.seq_len, m)
    validate_plan(p, m, local_ranks(world))
    check_executable(p, m, world)
    return p, world


def _check_data(data: Path | None) -> None:
    if data is not None and not data.is_file():
        raise PlaitError(f"data file {str(data)!r} does not exist; give a text file or omit --data")


def _train_config(p: Plan, m: ModelSpec, model: str, world: int, *, steps: int, seed: int, lr: float, dtype: str,
                  data: Path | None, metrics_file: Path | None, checkpoint_dir: Path | None, checkpoint_every: int,
                  timeout: float, resume_from: Path | None, hf_checkpoint: Path | None, adaptive: bool,
                  inject_slow: str | None, profile: Path | None, switch_via: str = "network",
                  replan_degrees: str = "any"):
    """The TrainConfig of a run with plan `p` (PlaitError on bad options)."""
    from plait.runtime.preflight import check_dtype, check_replan_degrees, check_switch_via
    from plait.runtime.train import TrainConfig, plan_offloads

    _check_data(data)
    check_dtype(dtype, plan_offloads(p))
    cfg = TrainConfig(model=model, plan=json.loads(p.model_dump_json()), steps=steps, seed=seed, lr=lr,
                      dtype=dtype, data=str(data) if data else None,
                      metrics_out=str(metrics_file) if metrics_file else None,
                      checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
                      checkpoint_every=checkpoint_every, timeout_s=timeout,
                      resume_from=str(resume_from) if resume_from else None,
                      hf_checkpoint=str(hf_checkpoint) if hf_checkpoint else None, adaptive=adaptive,
                      inject_slow=inject_slow, profile=str(profile) if profile else None,
                      switch_via=switch_via, replan_degrees=replan_degrees)
    check_switch_via(switch_via)
    check_replan_degrees(replan_degrees)
    if inject_slow is not None:
        from plait.runtime.stragglers import parse_injections

        parse_injections(inject_slow, world)
    if profile is not None:
        from plait.cost.profile_file import load_profile

        load_profile(profile)
    if hf_checkpoint is not None:
        _check_hf_checkpoint(hf_checkpoint, m)
    return cfg


def _check_hf_checkpoint(hf_checkpoint: Path, m: ModelSpec) -> None:
    from plait.models.hf_weights import HF_FAMILIES

    if m.family not in HF_FAMILIES:
        raise PlaitError(f"--hf-checkpoint loads {' and '.join(HF_FAMILIES)} models, not {m.family} "
                         f"({m.name}); drop it to start from the seed")
    if not any(hf_checkpoint.glob("*.safetensors")):
        raise PlaitError(f"--hf-checkpoint {str(hf_checkpoint)!r} holds no .safetensors files; give a Hugging "
                         "Face model directory")


def _check_restarts(m: ModelSpec, checkpoint_dir: Path | None, checkpoint_every: int, resume_from: Path | None,
                    max_restarts: int) -> None:
    """--checkpoint-every, --max-restarts and the checkpoints to save into and resume from."""
    if checkpoint_every < 0 or max_restarts < 0:
        raise PlaitError("--checkpoint-every and --max-restarts must be >= 0")
    if checkpoint_every and checkpoint_dir is None:
        raise PlaitError("--checkpoint-every saves into --checkpoint-dir; give --checkpoint-dir DIR or drop "
                         "--checkpoint-every")
    _check_checkpoints(checkpoint_dir, resume_from, m)


def _check_checkpoints(directory: Path | None, resume_from: Path | None, m: ModelSpec) -> None:
    """Before launching: the checkpoint directory can take a checkpoint, and the one to resume from is
    readable and holds this model (unreadable ones are skipped with a note)."""
    from plait.runtime import checkpoint
    from plait.runtime.preflight import check_checkpoint_dir

    if resume_from is not None:
        checkpoint.check_resume_from(resume_from, m)
    if directory is not None:
        check_checkpoint_dir(directory, m)
        if resume_from is None:
            checkpoint.resumable(directory, m, lambda line: None)  # rank 0 notes the ones it skips


def _varlen_config(m, model: str, method: str, world: int, steps: int, global_batch: int | None, seed: int,
                   lr: float, dtype: str, data: Path | None, metrics_out: Path | None, lengths: Path | None,
                   capacity: int, sp: int | None, cp_mode: str, states: str, offload_above: int, layout: object,
                   stages: int, other: object):
    """The TrainConfig of a `train --varlen` run (PlaitError on bad options) and its ranks."""
    from importlib.resources import files

    from plait.planner.varlen import load_lengths
    from plait.runtime.preflight import check_dtype
    from plait.runtime.train import TrainConfig
    from plait.runtime.varlen import check_config

    if layout:
        raise PlaitError("--varlen plans the layout of every step itself; drop --plan/--strategy")
    if steps <= 0 or world <= 0 or (global_batch is not None and global_batch <= 0):
        raise PlaitError("--steps, --nproc and --global-batch must be positive")
    check_dtype(dtype)
    if dtype == "bf16-pure":
        raise PlaitError("--varlen trains in fp32 or bf16 (autocast); drop --dtype bf16-pure")
    _check_data(data)
    path = str(lengths) if lengths else str(files("plait") / "data" / "wikipedia-lengths-10k.txt")
    load_lengths(path)
    cfg = TrainConfig(model=model, plan={}, steps=steps, seed=seed, lr=lr, dtype=dtype,
                      data=str(data) if data else None, metrics_out=str(metrics_out) if metrics_out else None,
                      varlen=method, lengths=path, global_batch=global_batch or 4 * world, capacity=capacity,
                      sp=sp, cp_mode=cp_mode, varlen_states=states,
                      offload_above=offload_above, varlen_stages=stages)
    check_config(cfg, m, world)
    if other:
        raise PlaitError("--hf-checkpoint, --adaptive, --inject-slow and --slurm do not combine with --varlen yet; "
                         "drop them")
    return cfg, world


def _launch(cfg, world: int, inside: bool, max_restarts: int, m: ModelSpec, nodes: Nodes) -> None:
    """Run `cfg` on `world` ranks: here when already inside torchrun, else through a new torchrun job
    (this node's share of it)."""
    from plait.runtime import preflight

    if not inside:
        with one_line_errors():
            preflight.check_host_memory(m, world // nodes.count)
    raise typer.Exit(run_job(cfg, world, inside, max_restarts, nodes))


def run_job(cfg, world: int, inside: bool, max_restarts: int, nodes: Nodes) -> int:
    """Run `cfg` on `world` ranks: here when already inside torchrun, else through a new torchrun job (this
    node's share of it); returns the job's exit code."""
    import os
    import subprocess
    import tempfile

    from plait.runtime.launch import ERROR_DIR_ENV

    nproc = world // nodes.count
    with tempfile.TemporaryDirectory(prefix="plait-train.") as tmp:
        config_path = os.path.join(tmp, "config.json")
        Path(config_path).write_text(cfg.to_json())
        if inside:
            from plait.runtime.worker import main as worker_main

            code = worker_main([config_path])
        else:
            cmd = [sys.executable, "-m", "plait.runtime.launch",
                   *torchrun_args(nodes, nproc, cfg.timeout_s, max_restarts), "-m", "plait.runtime.worker", config_path]
            env = {**os.environ, "OMP_NUM_THREADS": "1", ERROR_DIR_ENV: tmp}
            code = subprocess.run(cmd, check=False, env=env).returncode
    return code
