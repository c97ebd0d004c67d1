"""Interleaved model chunks on pipelines whose stages have different widths.

Each rank of device group d holds stages d, d + pp, d + 2 pp, ... (Megatron's virtual pipeline) and runs
their micro-batch forwards and backwards in the order the cost model prices
(`plait.cost.pipeline.schedule_order`: Megatron's interleaved 1F1B), so the bubble that runs is the bubble
that was priced. Each stage's forward and backward are `plait.runtime.pipeline_uneven.UnevenSchedule`'s;
every boundary tags its messages apart (`plait.runtime.boundary.Boundary.index`), since the ranks of two
device groups meet at several boundaries.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from plait.cost.pipeline import schedule_order
from plait.runtime.pipeline_uneven import UnevenSchedule


class ChunkedSchedule:
    """Device group `group` of `pp`'s share of a pipeline step over its stages `parts` (stage index -> that
    stage's schedule), with the step(inputs, target=, losses=) call of torch's schedules."""

    def __init__(self, parts: dict[int, UnevenSchedule], group: int, pp: int, micro_batches: int,
                 chunks: int) -> None:
        self.parts, self.micro_batches = parts, micro_batches
        self.first, self.last = 0, pp * chunks - 1
        self.steps = schedule_order("interleaved", pp, micro_batches, chunks)[group]

    def step(self, inputs: Tensor | None = None, target: Tensor | None = None,
             losses: list[Tensor] | None = None) -> None:
        """Forward and backward every micro-batch of every stage this rank holds: `inputs` (on the first
        stage's ranks) and `target` (the last's) hold the step's micro-batches one after another."""
        m = self.micro_batches
        xs = list(inputs.chunk(m)) if inputs is not None else [None] * m
        ys = list(target.chunk(m)) if target is not None else [None] * m
        saved: dict[tuple[int, int], tuple[Tensor | None, Tensor]] = {}  # (stage, micro-batch) -> F's tensors
        pending: list[tuple[dist.Work, Tensor]] = []
        for what, k, j in self.steps:
            part = self.parts[j]
            if what == "F":
                x = xs[k] if j == self.first else None
                y = ys[k] if j == self.last else None
                saved[(j, k)] = part._forward(x, y, losses, pending)
            else:
                part._backward(*saved.pop((j, k)), last=k == m - 1, pending=pending)
        for work, _ in pending:
            work.wait()
