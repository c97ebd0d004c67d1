"""`plait train` over several machines: the options that place this launcher in a job of several nodes,
and `--slurm FILE`, which writes an sbatch script that runs one launcher per node of a Slurm allocation."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from plait.errors import PlaitError
from plait.io import output_path, write_atomically

NnodesOpt = Annotated[int, typer.Option(
    "--nnodes", "--nodes", help="machines in the job, each running this command with --nproc ranks")]
NodeRankOpt = Annotated[int, typer.Option("--node-rank", help="this machine's place in the job, 0..nnodes-1")]
RdzvEndpointOpt = Annotated[str | None, typer.Option(
    "--rdzv-endpoint", help="HOST:PORT where node 0 serves the rendezvous (the same on every node)")]
SlurmOpt = Annotated[str | None, typer.Option(
    "--slurm", help="write an sbatch script running this training on --nodes machines, and stop")]
PartitionOpt = Annotated[str | None, typer.Option("--partition", help="--slurm: the Slurm partition")]
TimeLimitOpt = Annotated[str, typer.Option("--time", help="--slurm: the job's time limit, HH:MM:SS")]

RDZV_PORT = 29500
"""Default rendezvous port of a Slurm job (torchrun's default master port); PLAIT_RDZV_PORT overrides it."""
LAUNCH_OPTIONS = ("slurm", "partition", "time_limit", "nnodes", "node_rank", "rdzv_endpoint", "nproc")
"""Parameters of `plait train` that the sbatch script sets itself rather than passing on."""


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was given on the command line (not a default or an environment variable)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def train_arguments(ctx: typer.Context) -> list[str]:
    """The options given on the command line of this `plait train` call, less the launch ones, as
    arguments to pass on (defaults are left out)."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name or ""
        if name in LAUNCH_OPTIONS or not _given(ctx, name):
            continue
        value = ctx.params[name]
        if getattr(param, "is_flag", False):
            flag = param.opts[0] if value else (param.secondary_opts or [""])[0]
            args += [flag] if flag else []
        else:
            args += [param.opts[0], str(value)]
    return args


def sbatch_script(args: list[str], nodes: int, nproc: int, partition: str | None, time_limit: str) -> str:
    """An sbatch script: `nodes` machines, one task each, that runs `plait train ARGS` on every node with
    `nproc` ranks; the first host of the allocation serves the rendezvous, $SLURM_NODEID is the node rank."""
    header = ["--job-name=plait-train", f"--nodes={nodes}", "--ntasks-per-node=1", f"--gpus-per-node={nproc}",
              f"--time={time_limit}"] + ([f"--partition={partition}"] if partition else [])
    command = " ".join(shlex.quote(a) for a in ["train", *args, "--nnodes", str(nodes), "--nproc", str(nproc)])
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {line}" for line in header),
        "# Written by `plait train --slurm`: one launcher per node; the first node serves the rendezvous.",
        "# PLAIT: the command that runs plait (default `plait`); PLAIT_RDZV_PORT: the rendezvous port.",
        "set -euo pipefail",
        # sed, not head: head would end scontrol early, and pipefail would fail the job on its SIGPIPE
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)',
        f"PORT=${{PLAIT_RDZV_PORT:-{RDZV_PORT}}}",
        "PLAIT=${PLAIT:-plait}",
        f"srun --nodes={nodes} --ntasks={nodes} --ntasks-per-node=1 "
        "bash -c 'exec \"$@\" --node-rank \"$SLURM_NODEID\"' plait-node \\",
        f'  $PLAIT {command} --rdzv-endpoint "$HEAD:$PORT"',
        "",
    ])


def write_sbatch(path: str, ctx: typer.Context, nodes: int, nproc: int | None, partition: str | None,
                 time_limit: str) -> Path:
    """Check the --slurm options and write the script at `path` (atomically); the path written."""
    parts = time_limit.split(":")
    if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[1]) >= 60 or int(parts[2]) >= 60:
        raise PlaitError(f"--time {time_limit!r} is not HH:MM:SS; give e.g. --time 02:00:00")
    if nodes < 1 or (nproc is not None and nproc < 1):
        raise PlaitError("--nodes and --gpus-per-node (--nproc) must be positive")
    if _given(ctx, "node_rank") or _given(ctx, "rdzv_endpoint"):
        raise PlaitError("--slurm sets --node-rank and --rdzv-endpoint on every node itself; drop them")
    target = output_path(path, "train.sbatch", "--slurm")
    write_atomically(target, sbatch_script(train_arguments(ctx), nodes, nproc or 1, partition, time_limit))
    return target
