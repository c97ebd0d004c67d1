"""Task files: several training tasks that share modules of one multi-modal model (Spindle's workloads).

A task file (YAML) names the modules once and the tasks that use them:

    modules:
      vision: {tower: clip-l14}                                    # a vision tower preset (patches + layers)
      audio: {kind: encoder, layers: 12, hidden: 768, heads: 12, tokens: 229}   # a stack of one layer kind
      trunk: {model: llama3-8b}                                    # the layers of a model preset or inline spec
    tasks:
      - name: caption
        batch: 256          # samples per step
        seq_len: 2048       # tokens per sample of layers whose width is not fixed by the module
        modules: {vision: [], trunk: [vision]}                     # module -> the modules it takes input from

A module used by several tasks is shared (one set of weights, gradients summed over the tasks) unless it says
`shared: false`, in which case each task trains its own copy. Bad input raises PlaitError with one line that
says what is wrong and how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plait.errors import PlaitError
from plait.spec import stacks
from plait.spec.layers import Block
from plait.spec.model import load_model

Count = Annotated[int, Field(gt=0)]


class _ModuleFile(BaseModel):
    """One module: exactly one of `tower`, `model` or `kind` (+ `layers` and the Block fields)."""

    model_config = ConfigDict(extra="allow")

    tower: str | None = None
    project_to: int = Field(default=0, ge=0)  # a tower's projector into this width (0: no projector)
    model: str | None = None
    layers: int = Field(default=0, ge=0)
    shared: bool = True


class _TaskFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    batch: Count
    seq_len: Count
    modules: dict[str, list[str]] = Field(min_length=1)


class _TasksFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modules: dict[str, _ModuleFile] = Field(min_length=1)
    tasks: list[_TaskFile] = Field(min_length=1)


@dataclass(frozen=True)
class Module:
    """A named sequence of layers; `shared`: one set of weights for every task that uses it."""

    name: str
    stack: tuple[Block, ...]
    shared: bool = True


@dataclass(frozen=True)
class Task:
    """One task: `batch` samples of `seq_len` tokens per step through its modules; `inputs[m]` lists the
    modules whose outputs module m reads (every name in `modules`, in file order)."""

    name: str
    batch: int
    seq_len: int
    modules: tuple[str, ...]
    inputs: tuple[tuple[str, ...], ...]

    def inputs_of(self, module: str) -> tuple[str, ...]:
        return self.inputs[self.modules.index(module)]


@dataclass(frozen=True)
class TaskSet:
    """The modules and the tasks of one task file."""

    name: str
    modules: tuple[Module, ...]
    tasks: tuple[Task, ...]

    def module(self, name: str) -> Module:
        return next(m for m in self.modules if m.name == name)

    def width(self, module: str) -> int:
        """The hidden width of `module`'s first layer (what it reads in, after any projection)."""
        return self.module(module).stack[0].hidden

    def input_widths(self, task: Task, module: str) -> tuple[int, ...]:
        """Widths of what `module` reads in `task`, one per input: its sources' outputs, or (a module that
        reads none) the task's token embedding, which has the width of the task's first module."""
        sources = task.inputs_of(module)
        if not sources:
            return (self.width(task.modules[0]),)
        return tuple(self.module(s).stack[-1].hidden for s in sources)

    def projected(self, task: Task, module: str) -> tuple[int, ...]:
        """The input widths `module` projects to its own width in `task` (a learned Linear(w, width) per
        input of another width w, its first op; ImageBind's and LLaVA's modality projectors)."""
        return tuple(w for w in self.input_widths(task, module) if w != self.width(module))

    def users(self, module: str) -> tuple[str, ...]:
        """Names of the tasks that run `module`."""
        return tuple(t.name for t in self.tasks if module in t.modules)


def _module_stack(name: str, spec: _ModuleFile) -> tuple[Block, ...]:
    """The layers of one module file entry."""
    extra = dict(spec.model_extra or {})
    given = [k for k in ("tower", "model", "kind") if (getattr(spec, k, None) if k != "kind" else extra.get(k))]
    if len(given) != 1:
        raise PlaitError(f"module {name!r}: give exactly one of tower (a vision tower), model (a preset or inline "
                         f"spec) or kind (a layer kind with layers, hidden, heads, ...); got {given or 'none'}")
    if spec.tower is not None:
        if spec.tower not in stacks.VISION_TOWERS:
            raise PlaitError(f"module {name!r}: unknown tower {spec.tower!r}; use one of "
                             f"{', '.join(stacks.VISION_TOWERS)}")
        tower = stacks.vision_stack(stacks.VISION_TOWERS[spec.tower], spec.project_to or 1)
        return tower if spec.project_to else tower[:-1]
    if spec.model is not None:
        return load_model(spec.model).stack
    if spec.layers <= 0:
        raise PlaitError(f"module {name!r}: a {extra['kind']} stack needs layers: a positive count")
    try:
        block = Block(**extra)
    except TypeError as exc:
        raise PlaitError(f"module {name!r}: {exc}; use the layer fields of docs/layer-kinds.md") from None
    return (block,) * spec.layers


def _task(t: _TaskFile, modules: dict[str, Module]) -> Task:
    for m, sources in t.modules.items():
        for name in (m, *sources):
            if name not in modules:
                raise PlaitError(f"task {t.name!r} uses module {name!r}, which the file does not define; "
                                 f"define it under modules (defined: {', '.join(modules)})")
            if name not in t.modules:
                raise PlaitError(f"task {t.name!r}: module {m!r} reads {name!r}, which the task does not run; "
                                 f"add {name!r} to the task's modules")
    order: list[str] = []
    while len(order) < len(t.modules):  # Kahn's order; a pass without progress means a cycle
        ready = [m for m, src in t.modules.items() if m not in order and all(s in order for s in src)]
        if not ready:
            raise PlaitError(f"task {t.name!r}: the module inputs form a cycle; a module cannot feed itself")
        order += ready
    return Task(t.name, t.batch, t.seq_len, tuple(t.modules), tuple(tuple(s) for s in t.modules.values()))


def parse_tasks(data: object, name: str = "tasks") -> TaskSet:
    """A TaskSet from the parsed YAML of a task file."""
    try:
        f = _TasksFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise PlaitError(f"task file {name}: {where}: {first['msg']}") from None
    modules = {n: Module(n, _module_stack(n, m), m.shared) for n, m in f.modules.items()}
    tasks = tuple(_task(t, modules) for t in f.tasks)
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise PlaitError(f"task file {name}: task names repeat ({', '.join(names)}); give each task its own name")
    return TaskSet(name, tuple(modules.values()), tasks)


def load_tasks(path: Path) -> TaskSet:
    """Read and validate a task file (YAML)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise PlaitError(f"cannot read task file {str(path)!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise PlaitError(f"task file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
    return parse_tasks(data, Path(path).stem)
