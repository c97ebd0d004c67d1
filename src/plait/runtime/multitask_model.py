"""The torch model of a task file for `plait train --tasks`, its synthetic batches, and the one-process
reference step that the multi-group runtime (`plait.runtime.multitask`) must match.

Every module is its stack of pre-norm attention + MLP layers (`plait.models.parts.pre_norm_layer`); a module
used by several tasks is one set of weights unless it says `shared: false` (then one copy per task). Each task
has its own token embedding (read by the modules that read no other module) and its own head (a norm and a
linear layer to the vocabulary) after each of its last modules (those no other module of the task reads),
trained on next-token cross entropy over synthetic tokens; a task that ends in several modules (ImageBind's
image-text ends in both towers) has one head per last module and its loss is the mean of theirs, each
head's next-token loss on its own module's output (a stand-in: a task file names no loss, and ImageBind's
contrastive loss between the towers is not run; the planner prices no head). A module
that reads several modules adds their outputs. Every module runs on the task's `seq_len` tokens (`tokens` of
a layer is the planner's business). Modules may differ in hidden width: a module that reads an input of
another width first projects it (a learned Linear(input width, its width), owned by the consumer, one per
input width; as ImageBind's and LLaVA's projectors). The task's embedding has the width of
its first module; each head, that of its module.
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
"""Layer kinds the runtime builds for a task file: self-attention + MLP layers of one width per module."""


def sinks(task: Task) -> list[str]:
    """The task's last modules, in the task's order: those no other module of the task reads."""
    read = {s for sources in task.inputs for s in sources}
    return [m for m in task.modules if m not in read]


def head_key(tasks: TaskSet, task: Task, module: str) -> str:
    """The name of the head after `module`, a last module of `task`: the task's index, with the module's name
    when the task ends in several."""
    index = str(tasks.tasks.index(task))
    return index if len(sinks(task)) == 1 else f"{index}:{module}"


def check_runnable(tasks: TaskSet) -> None:
    """PlaitError unless the runtime can build the task file: attention layers of one hidden width within
    each module."""
    for m in tasks.modules:
        kinds = sorted({b.kind for b in m.stack} - set(RUNNABLE_KINDS))
        if kinds:
            raise PlaitError(f"module {m.name!r} has {', '.join(kinds)} layers; `plait train --tasks` runs "
                             f"{', '.join(RUNNABLE_KINDS)} layers: use kind: decoder/encoder/vision")
        widths = sorted({b.hidden for b in m.stack})
        if len(widths) != 1:
            raise PlaitError(f"module {m.name!r} has layers of hidden widths {widths}; `plait train --tasks` "
                             "projects between modules only: split it into modules of one width each")


def stack_key(tasks: TaskSet, task: Task, module: str) -> str:
    """The name of the weights `task` runs as `module`: the module's own, or the task's copy."""
    return module if tasks.module(module).shared else f"{module}@{tasks.tasks.index(task)}"


def projection_key(tasks: TaskSet, task: Task, module: str, width_in: int) -> str:
    """The name of the projection into `module` (as `task` runs it) from inputs of width `width_in`."""
    return f"{stack_key(tasks, task, module)}:{width_in}"


class TaskModel(nn.Module):
    """Every module's layers (`stacks`), each task's embedding (keyed by task index) and heads (`head_key`),
    and the projections into modules that read another width (`project`, keyed by `projection_key`)."""

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
        self.embed = nn.ModuleDict({str(i): nn.Embedding(VOCAB, tasks.width(t.modules[0]))
                                    for i, t in enumerate(tasks.tasks)})
        self.head = nn.ModuleDict()
        for t in tasks.tasks:
            for m in sinks(t):
                b = tasks.module(m).stack[-1]
                self.head[head_key(tasks, t, m)] = nn.Sequential(norm(b), nn.Linear(b.hidden, VOCAB))
        self.project = nn.ModuleDict()  # after the rest: a task file of one width initialises as before
        for t in tasks.tasks:
            for m in t.modules:
                for w in tasks.input_widths(t, m):
                    key = projection_key(tasks, t, m, w)
                    if w != tasks.width(m) and key not in self.project:
                        self.project[key] = nn.Linear(w, tasks.width(m))

    def projections(self, task: int, module: str) -> list[nn.Module]:
        """The projections into `module` as task `task` runs it (none when its inputs have its width)."""
        t = self.tasks.tasks[task]
        keys = {projection_key(self.tasks, t, module, w) for w in self.tasks.input_widths(t, module)}
        return [self.project[k] for k in sorted(keys) if k in self.project]

    def enter(self, task: int, module: str, inputs: list[Tensor], weight: float = 1.0) -> Tensor:
        """`module`'s input [B, T, H] from what it reads ([B, T, H_in] each): their sum, each input of
        another width first projected to H. `weight` scales the projections' gradients from this call."""
        t, h = self.tasks.tasks[task], self.tasks.width(module)
        return sum(x if x.shape[-1] == h else
                   weighted_call(self.project[projection_key(self.tasks, t, module, x.shape[-1])], weight, x)
                   for x in inputs)

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

    def loss(self, task: int, module: str, x: Tensor, tokens: Tensor, span: tuple[int, int] | None = None,
             weight: float = 1.0) -> Tensor:
        """The share of the task's loss from its head after `module` (one of its last modules) on x [B, T, H]:
        next-token cross entropy (mean over the rows and positions given: `span` of the tokens [B, T+1];
        default all) over the number of the task's heads. `weight` scales the head's gradient."""
        t = self.tasks.tasks[task]
        start, stop = span or (0, tokens.shape[1] - 1)
        logits = weighted_call(self.head[head_key(self.tasks, t, module)], weight, x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, start + 1:stop + 1].reshape(-1))
        return loss / len(sinks(t))


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
        x = model.enter(task, m, [out[s] for s in sources] if sources else [model.embed_tokens(task, tokens)])
        out[m] = model.layers(task, m, 0, len(model.tasks.module(m).stack), x)
    return sum(model.loss(task, m, out[m], tokens) for m in sinks(t))


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
