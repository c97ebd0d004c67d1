"""The graph of MetaOps: each task's modules cut into chains of identical layers, joined by dependencies."""

from __future__ import annotations

from dataclasses import dataclass

from plait.spec.layers import Block
from plait.spec.tasks import TaskSet


@dataclass(frozen=True)
class MetaOp:
    """`layers` consecutive identical layers of one module run by one task on `batch` samples per step of
    `seq_len` tokens (layers with a fixed width, `block.tokens`, ignore it). A module's first op also runs
    the projections of its inputs of other widths (`project_from`: their widths, one per input)."""

    name: str
    task: str
    module: str
    block: Block
    layers: int
    batch: int
    seq_len: int
    project_from: tuple[int, ...] = ()

    @property
    def flops(self) -> float:
        """Forward FLOPs of one step (multiply-add = 2), input projections (2 tokens h_in h_out) included."""
        tokens = self.batch * self.block.seq(self.seq_len)
        project = sum(2 * tokens * w * self.block.hidden for w in self.project_from)
        return self.layers * tokens * self.block.flops_per_token(self.seq_len) + project


@dataclass(frozen=True)
class Graph:
    """MetaOps and dependency edges (producer index, consumer index)."""

    ops: tuple[MetaOp, ...]
    edges: tuple[tuple[int, int], ...]

    def predecessors(self, op: int) -> tuple[int, ...]:
        return tuple(a for a, b in self.edges if b == op)

    def task_ops(self, task: str) -> tuple[int, ...]:
        return tuple(i for i, op in enumerate(self.ops) if op.task == task)


def chains(stack: tuple[Block, ...]) -> list[tuple[Block, int]]:
    """Runs of identical consecutive layers: (layer, count) in order."""
    out: list[tuple[Block, int]] = []
    for block in stack:
        if out and out[-1][0] == block:
            out[-1] = (block, out[-1][1] + 1)
        else:
            out.append((block, 1))
    return out


def build_graph(tasks: TaskSet) -> Graph:
    """One chain of MetaOps per (task, module); a module's first op depends on the last op of each module
    it reads."""
    ops: list[MetaOp] = []
    edges: list[tuple[int, int]] = []
    for task in tasks.tasks:
        ends: dict[str, tuple[int, int]] = {}  # module -> (first op, last op)
        for module in task.modules:
            runs = chains(tasks.module(module).stack)
            first = len(ops)
            for k, (block, count) in enumerate(runs):
                suffix = f"#{k}" if len(runs) > 1 else ""
                ops.append(MetaOp(f"{task.name}/{module}{suffix}", task.name, module, block, count, task.batch,
                                  task.seq_len, tasks.projected(task, module) if k == 0 else ()))
                if k:
                    edges.append((len(ops) - 2, len(ops) - 1))
            ends[module] = (first, len(ops) - 1)
        for module in task.modules:
            edges += [(ends[src][1], ends[module][0]) for src in task.inputs_of(module)]
    return Graph(tuple(ops), tuple(edges))
