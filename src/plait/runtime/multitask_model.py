"""The torch model of a task file for `plait train --tasks`, its synthetic batches, and the one-process
reference step that the multi-group runtime (`plait.runtime.multitask`) must match.

Every module is its stack of pre-norm attention + MLP layers (`plait.models.parts.pre_norm_layer`); a module
used by several tasks is one set of weights unless it says `shared: false` (then one copy per task). Each task
has its own token embedding (read by the modules that read no other module) and its own head (a norm and a
linear layer to the vocabulary after its last module), trained on next-token cross entropy over synthetic
tokens. A module that reads several modules adds their outputs. Every module runs on the task's `seq_len`
tokens (`tokens` of a layer is the planner's business), so all modules share one hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.errors import PlaitError
from plait.models.parts import norm, pre_norm_layer
from plait.runtime.multitask_groups import weighted_call
from plait.runtime.optim import make_optimizer
from plait.spec.tasks import Task, TaskSet

VOCAB = 256
"""Tokens of the synthetic data (a byte-sized vocabulary, as train's text data)."""
RUNNABLE_KINDS = ("decoder", "encoder", "vision")
"""Layer kinds the runtime builds for a task file: self-attention + MLP layers of one width."""


def sink(task: Task) -> str:
    """The task's last module: the one no other module of the task reads."""
    read = {s for sources in task.inputs for s in sources}
    return next(m for m in task.modules if m not in read)


def check_runnable(tasks: TaskSet) -> None:
    """PlaitError unless the runtime can build the task file: attention layers of one hidden width, one last
    module per task."""
    widths = {b.hidden for m in tasks.modules for b in m.stack}
    for m in tasks.modules:
        kinds = sorted({b.kind for b in m.stack} - set(RUNNABLE_KINDS))
        if kinds:
            raise PlaitError(f"module {m.name!r} has {', '.join(kinds)} layers; `plait train --tasks` runs "
                             f"{', '.join(RUNNABLE_KINDS)} layers: use kind: decoder/encoder/vision")
    if len(widths) != 1:
        raise PlaitError(f"the modules have hidden widths {sorted(widths)}; `plait train --tasks` hands "
                         "activations between modules unchanged: give every module the same hidden")
    for t in tasks.tasks:
        read = {s for sources in t.inputs for s in sources}
        last = [m for m in t.modules if m not in read]
        if len(last) != 1:
            raise PlaitError(f"task {t.name!r} ends in {len(last)} modules ({', '.join(last)}); the runtime puts "
                             "one head after one last module: let one of them read the others")


def stack_key(tasks: TaskSet, task: Task, module: str) -> str:
    """The name of the weights `task` runs as `module`: the module's own, or the task's copy."""
    return module if tasks.module(module).shared else f"{module}@{tasks.tasks.index(task)}"


class TaskModel(nn.Module):
    """Every module's layers (`stacks`), and each task's embedding and head (keyed by task index)."""

    def __init__(self, tasks: TaskSet, seed: int) -> None:
        super().__init__()
        check_runnable(tasks)
        torch.manual_seed(seed)
        self.tasks = tasks
        self.stacks = nn.ModuleDict()
        for m in tasks.modules:
            keys = [m.name] if m.shared else [stack_key(tasks, t, m.name) for t in tasks.tasks if m.name in t.modules]
            for key in keys:
                self.stacks[key] = nn.ModuleList(pre_norm_layer(b) for b in m.stack)
        block = tasks.modules[0].stack[0]
        self.embed = nn.ModuleDict({str(i): nn.Embedding(VOCAB, block.hidden) for i in range(len(tasks.tasks))})
        self.head = nn.ModuleDict({str(i): nn.Sequential(norm(block), nn.Linear(block.hidden, VOCAB))
                                   for i in range(len(tasks.tasks))})

    def layers(self, task: int, module: str, lo: int, hi: int, x: Tensor) -> Tensor:
        """Layers lo..hi-1 of `module` as task `task` runs it: [B, T, H] -> [B, T, H]."""
        stack = self.stacks[stack_key(self.tasks, self.tasks.tasks[task], module)]
        for layer in stack[lo:hi]:
            x = layer(x)
        return x

    def embed_tokens(self, task: int, tokens: Tensor, span: tuple[int, int] | None = None, weight: float = 1.0
                     ) -> Tensor:
        """The task's input tokens [B, T+1] embedded: [B, T, H] (the last token is only a target); with
        `span`, positions [start, stop) only. `weight` scales the embedding's gradient from this call."""
        start, stop = span or (0, tokens.shape[1] - 1)
        return weighted_call(self.embed[str(task)], weight, tokens[:, start:stop])

    def loss(self, task: int, x: Tensor, tokens: Tensor, span: tuple[int, int] | None = None, weight: float = 1.0
             ) -> Tensor:
        """Next-token cross entropy (mean over the rows and positions given) of the task's head on x [B, T, H]
        (positions `span` of the tokens [B, T+1]; default all). `weight` scales the head's gradient."""
        start, stop = span or (0, tokens.shape[1] - 1)
        logits = weighted_call(self.head[str(task)], weight, x)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, start + 1:stop + 1].reshape(-1))


def batch(tasks: TaskSet, task: int, step: int, seed: int) -> Tensor:
    """Task `task`'s synthetic tokens of step `step`: [batch, seq_len + 1], the same on every rank."""
    t = tasks.tasks[task]
    g = torch.Generator().manual_seed(hash((seed, step, task)) & 0x7FFF_FFFF)
    return torch.randint(VOCAB, (t.batch, t.seq_len + 1), generator=g)


def task_loss(model: TaskModel, task: int, tokens: Tensor) -> Tensor:
    """One task's loss on its whole batch in one process: its modules in order."""
    t = model.tasks.tasks[task]
    out: dict[str, Tensor] = {}
    for m in t.modules:
        sources = t.inputs_of(m)
        x = sum(out[s] for s in sources) if sources else model.embed_tokens(task, tokens)
        out[m] = model.layers(task, m, 0, len(model.tasks.module(m).stack), x)
    return model.loss(task, out[sink(t)], tokens)


def reference_steps(tasks: TaskSet, steps: int, seed: int, lr_of, clip: float = 0.0
                    ) -> list[tuple[list[float], float]]:
    """Per step, every task's loss in one process and the gradient norm before clipping: the sum of the
    tasks' losses is the step's loss, its gradients clipped to global norm `clip` (0: not clipped), then
    one optimizer step (`lr_of(step)`: its learning rate). What the runtime's plans must reproduce."""
    model = TaskModel(tasks, seed)
    optimizer = make_optimizer(model.parameters(), lr_of(0))
    out = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_of(step)
        losses = [task_loss(model, i, batch(tasks, i, step, seed)) for i in range(len(tasks.tasks))]
        sum(losses).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), clip, norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(([loss.item() for loss in losses], float(norm)))
    return out


def reference_losses(tasks: TaskSet, steps: int, seed: int, lr_of, clip: float = 0.0) -> list[list[float]]:
    """Per step, every task's loss in one process (`reference_steps`)."""
    return [losses for losses, _ in reference_steps(tasks, steps, seed, lr_of, clip)]
