"""How much torch 2.8/2.9's lock-step interleaved 1F1B costs over the dependency-driven schedule plait prices.

    python benchmarks/torch_lockstep.py

torch 2.8 and 2.9 run `ScheduleInterleaved1F1B` as a `PipelineScheduleMulti`: every rank walks the same table of
time steps (`pipeline_order`, one action or an empty slot per rank and step) and at each step posts its own
sends together with the receives its neighbours' actions of that step imply, then waits on all of them before
the next step. A rank's step therefore ends only when each neighbour it exchanges with at that step has
finished its own action. plait's simulator (`plait.cost.pipeline`) runs the same per-rank op order but lets an
op start as soon as its input has arrived. This script builds the table with torch's own code and times it in
lock step, beside plait's makespan with asynchronous exchanges and as plait prices these rows (`p2p=torch`:
each op holds its device for MEGATRON_P2P_HOLD times its send), for forward:backward ratios of 1:2 (no recomputation) and 1:3 (full
recomputation), at the shapes of the NeMo AutoModel DeepSeek-V3 and Kimi K2 rows of
benchmarks/data/published_runs.json (8 micro-batches a schedule run; pp 4 with 8 chunks per rank, pp 8 with 4)
and a few others.
"""

from __future__ import annotations

import sys
import types

from rich.console import Console
from rich.table import Table

from plait.cost.pipeline import StageTimes, p2p_hold, simulate_pipeline

try:  # torch's table builder, unchanged from 2.8.0 to 2.13.0 (private API)
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    from torch.distributed.pipelining.schedules import _ComputationType as Kind
except ImportError as exc:  # pragma: no cover - depends on the installed torch
    print(f"this torch has no pipelining schedules ({exc}); install torch>=2.8", file=sys.stderr)
    raise SystemExit(2) from None

SHAPES = ((4, 8, 8), (8, 4, 8), (4, 7, 8), (4, 4, 8), (4, 2, 8), (2, 2, 4), (8, 2, 16))
"""(pipeline ranks, chunks per rank, micro-batches per schedule run): AutoModel's DeepSeek-V3 and Kimi K2 rows
first, then other shapes."""
RATIOS = ((1.0, 2.0), (1.0, 3.0))
"""(forward, backward) seconds of one chunk and micro-batch."""
SEND_S = 0.02
"""Seconds of one activation exchange, in the same units (2% of a chunk's forward)."""


def torch_table(p: int, v: int, m: int) -> list[list]:
    """Per-rank list of torch actions (None: an empty slot), padded to a common length."""
    shape = types.SimpleNamespace(pp_group_size=p, n_local_stages=v, _n_microbatches=m)
    shape.number_of_rounds = max(1, m // p)
    shape.microbatches_per_round = m // shape.number_of_rounds
    rows = [ScheduleInterleaved1F1B._calculate_single_rank_operations(shape, r) for r in range(p)]
    steps = max(len(r) for r in rows)
    return [r + [None] * (steps - len(r)) for r in rows]


def _sends_to(action, p: int, stages: int) -> int | None:
    """The rank `action` sends its output to (None: it sends nothing)."""
    if action is None:
        return None
    s = action.stage_index
    if action.computation_type == Kind.FORWARD:
        return (s + 1) % p if s + 1 < stages else None
    return (s - 1) % p if s > 0 else None


def lockstep_makespan(p: int, v: int, m: int, fwd: float, bwd: float, send: float) -> float:
    """Seconds of one schedule run when every step waits on the exchanges of that step (torch 2.8/2.9)."""
    table = torch_table(p, v, m)
    end = [0.0] * p
    for step in range(len(table[0])):
        actions = [table[r][step] for r in range(p)]
        done = [end[r] + (0.0 if a is None else fwd if a.computation_type == Kind.FORWARD else bwd)
                for r, a in enumerate(actions)]
        peers: list[set[int]] = [set() for _ in range(p)]
        for r, a in enumerate(actions):
            to = _sends_to(a, p, p * v)
            if to is not None:  # a send completes once the receiver has posted its receive, and vice versa
                peers[r].add(to)
                peers[to].add(r)
        new = [max([done[r], *(done[q] for q in peers[r])]) + (send if peers[r] else 0.0) for r in range(p)]
        end = new
    return max(end)


def main() -> None:
    table = Table(title="one schedule run: torch 2.8/2.9 lock step vs plait's dependency-driven order")
    for col in ("pp", "chunks", "micro-batches", "fwd:bwd", "lock step", "plait async", "plait p2p=torch",
                "lock step / plait p2p=torch"):
        table.add_column(col, justify="right")
    for p, v, m in SHAPES:
        for fwd, bwd in RATIOS:
            lock = lockstep_makespan(p, v, m, fwd, bwd, SEND_S)
            stages = [StageTimes(forward_s=fwd, backward_s=bwd, send_s=SEND_S)] * (p * v)
            free = simulate_pipeline(stages, m, "interleaved", chunks=v).makespan_s
            ours = simulate_pipeline(stages, m, "interleaved", chunks=v, hold=p2p_hold("torch")).makespan_s
            table.add_row(str(p), str(v), str(m), f"{fwd:g}:{bwd:g}", f"{lock:.2f}", f"{free:.2f}", f"{ours:.2f}",
                          f"{lock / ours:.3f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
