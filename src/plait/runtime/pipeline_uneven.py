"""A GPipe / 1F1B schedule for pipelines whose stages have different widths.

torch.distributed.pipelining pairs each stage with one peer rank, so it runs only stages of equal widths.
Here every rank runs its stage's order of micro-batch forwards (F) and backwards (B): GPipe does every F
then every B; 1F1B does `stages - 1 - index` forwards first, then alternates, then drains the backwards.
Activations and gradients cross stages through `plait.runtime.boundary` (non-blocking sends, blocking
receives, so any order that respects the data dependencies runs). The last stage's loss of each
micro-batch is divided by the micro-batch count before its backward (torch's schedules scale the
gradients by the same count). With `blocking` (p2p=megatron) each forward and backward first completes the
stage's sends in flight together with its own receive, as Megatron-LM's p2p_communication posts a send with
the next receive and waits on both, so no stage computes ahead of its last exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from plait.models.mtp import next_token_kwargs
from plait.runtime.boundary import Boundary
from plait.runtime.zero import micro_batch_flags


def order(kind: str, stages: int, index: int, micro_batches: int) -> list[tuple[str, int]]:
    """The ("F" | "B", micro-batch) order of stage `index` of `stages` under `kind` (gpipe or 1f1b)."""
    if kind == "gpipe":
        return [("F", k) for k in range(micro_batches)] + [("B", k) for k in range(micro_batches)]
    warmup = min(stages - 1 - index, micro_batches)
    out = [("F", k) for k in range(warmup)]
    for k in range(micro_batches - warmup):
        out += [("F", warmup + k), ("B", k)]
    return out + [("B", k) for k in range(micro_batches - warmup, micro_batches)]


class UnevenSchedule:
    """One stage's share of a pipeline step, with the step(inputs, target=, losses=) call of torch's
    schedules."""

    def __init__(self, chunk: nn.Module, index: int, stages: int, before: Boundary | None, after: Boundary | None,
                 micro_batches: int, loss_fn: Callable[[Tensor, Tensor], Tensor], kind: str,
                 timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 blocking: bool = False) -> None:
        self.blocking = blocking
        self.chunk, self.before, self.after, self.loss_fn, self.timed = chunk, before, after, loss_fn, timed
        self.micro_batches = micro_batches
        self.steps = order(kind, stages, index, micro_batches)
        first = next(chunk.parameters())
        self.dtype, self.device = first.dtype, first.device  # of the pieces that cross stages

    def step(self, inputs: Tensor | None = None, target: Tensor | None = None,
             losses: list[Tensor] | None = None) -> None:
        """Forward and backward every micro-batch: `inputs` (first stage) and `target` (last stage) hold the
        step's micro-batches one after another; the last stage appends each micro-batch's loss to `losses`."""
        m = self.micro_batches
        xs = list(inputs.chunk(m)) if inputs is not None else [None] * m
        ys = list(target.chunk(m)) if target is not None else [None] * m
        saved: dict[int, tuple[Tensor | None, Tensor]] = {}  # micro-batch -> (received input, output or loss)
        pending: list[tuple[dist.Work, Tensor]] = []  # sends in flight, with their buffers
        for what, k in self.steps:
            if what == "F":
                saved[k] = self._forward(xs[k], ys[k], losses, pending)
            else:
                self._backward(*saved.pop(k), last=k == m - 1, pending=pending)
        for work, _ in pending:
            work.wait()

    def _forward(self, x: Tensor | None, y: Tensor | None, losses: list[Tensor] | None,
                 pending: list[tuple[dist.Work, Tensor]]) -> tuple[Tensor | None, Tensor]:
        """One micro-batch's forward: (the input received from the previous stage, the output or loss)."""
        if self.before is not None:
            x = self.before.receive(True, self.dtype, self.device).requires_grad_()
        self._settle(pending)
        with self.timed():
            out = self.chunk(x, **next_token_kwargs(self.chunk, y))
            if self.after is None:
                out = self.loss_fn(out, y)
                if losses is not None:
                    losses.append(out.detach())
        if self.after is not None:
            pending += self.after.send(out.detach().to(self.dtype), forward=True)
        return (x if self.before is not None else None), out

    def _backward(self, x: Tensor | None, out: Tensor, last: bool, pending: list[tuple[dist.Work, Tensor]]) -> None:
        """One micro-batch's backward (`last`: the step's last, after which ZeRO-1 reduces), from its loss or
        the gradient the next stage sends; sends the input's gradient to the previous stage."""
        grad = None if self.after is None else self.after.receive(False, self.dtype, self.device).to(out.dtype)
        self._settle(pending)
        micro_batch_flags(self.chunk, last=last)
        with self.timed():
            if grad is None:
                (out / self.micro_batches).backward()
            else:
                torch.autograd.backward(out, grad)
        if x is not None and self.before is not None:
            pending += self.before.send(x.grad, forward=False)

    def _settle(self, pending: list[tuple[dist.Work, Tensor]]) -> None:
        """With `blocking`, wait for every send in flight (after this op's receive, before its compute)."""
        if self.blocking:
            for work, _ in pending:
                work.wait()
            pending.clear()
