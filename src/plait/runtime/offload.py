"""Optimizer offload as `plait.cost.offload` prices it (ZeRO-Offload, ZeRO-Infinity): the CPU steps AdamW on
fp32 master copies of the offloaded parameters' local shards, whose optimizer states live in host memory
(`offload="optim"`) or in files on the node's NVMe (`offload="nvme"`).

`HostAdamW` is the one optimizer of a chunk (so checkpoints save its state by parameter name, like
`torch.optim.AdamW`'s): the parameters it does not host step as AdamW steps them; for each hosted one, the
step copies the (clipped) gradient of this rank's shard to the host and drops it on the device, runs AdamW on
the CPU over the master copy and the moments (`torch.optim.adamw.adamw`, the same arithmetic), and copies the
updated shard back into the device's parameter. The device keeps the parameters, not their gradients or
optimizer states; under FSDP2 the shard is this rank's ZeRO shard, elsewhere its whole (tensor-parallel) local
tensor: ZeRO-Offload's single-GPU case.

Under "nvme" each hosted shard's master copy, fp32 gradient and two moments are one file of four rows
(`StateFile`, a numpy memmap under a per-rank directory): the gradient is written there after backward, and
around the CPU step the four rows are read into memory and written back (flushed), so the bytes really go
through the file system; `OffloadMeter` counts them. The parameter shard itself is paged as under
offload="params" (FSDP2's CPUOffloadPolicy, `plait.runtime.zero.paging`).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

from plait.runtime.placement import Chunk

HOSTED = ("optim", "nvme")
"""Offload choices whose optimizer steps on the host CPU (`HostAdamW`)."""
STATE_ROWS = ("master", "grad", "exp_avg", "exp_avg_sq")
"""The fp32 rows of one hosted shard's state file, in order."""


@dataclass
class OffloadMeter:
    """Bytes one step moved for offloaded optimizer states: gradients to the host, updated shards back to the
    device, and state read from and written to NVMe files."""

    to_host: float = 0.0
    to_device: float = 0.0
    nvme_read: float = 0.0
    nvme_written: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class StateFile:
    """One hosted shard's fp32 state (`STATE_ROWS` x `numel`) in a file, memory-mapped."""

    def __init__(self, path: Path, numel: int) -> None:
        self.path, self.numel = path, numel
        self.map = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                             shape=(len(STATE_ROWS), numel))

    @property
    def nbytes(self) -> int:
        return int(self.map.nbytes)

    def row(self, name: str) -> Tensor:
        """A tensor over the file's row `name` (its pages, not a copy)."""
        return torch.from_numpy(self.map[STATE_ROWS.index(name)])

    def read(self) -> Tensor:
        """The four rows, read into memory."""
        return torch.from_numpy(np.array(self.map))

    def write(self, rows: Tensor) -> None:
        """Write `rows` (as `read` returns them) to the file and flush it."""
        self.map[...] = rows.numpy()
        self.map.flush()


def local(t: Tensor) -> Tensor:
    """The tensor this rank holds of `t` (a DTensor's local shard, which in-place copies update)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def like(p: Tensor, host: Tensor) -> Tensor:
    """`host` (this rank's part of a state of `p`, in host memory or a file) laid out as `p` is: a DTensor
    with `p`'s mesh and placements, so checkpoints save and reshard it as they do AdamW's states."""
    if not isinstance(p, DTensor):
        return host
    return DTensor.from_local(host, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


class HostAdamW(torch.optim.AdamW):
    """AdamW whose `hosted` parameters (id -> "optim" or "nvme") step on the CPU (see the module)."""

    def __init__(self, params: Iterable[nn.Parameter], hosted: dict[int, str], nvme_dir: Path | None = None,
                 **adamw: object) -> None:
        super().__init__(params, **adamw)  # type: ignore[arg-type]
        mine = [p for group in self.param_groups for p in group["params"] if id(p) in hosted]
        self.hosted = {id(p): hosted[id(p)] for p in mine}
        self._order = {id(p): i for i, p in enumerate(mine)}  # names the state files
        self.meter = OffloadMeter()
        self._masters: dict[int, Tensor] = {}
        self._files: dict[int, StateFile] = {}
        self._grads: dict[int, Tensor] = {}
        self._dir = nvme_dir
        self.register_load_state_dict_post_hook(HostAdamW._after_load)

    def _nvme(self, p: Tensor) -> bool:
        return self.hosted.get(id(p)) == "nvme"

    def _file(self, p: Tensor) -> StateFile:
        """`p`'s state file (made on first use, the master row from the parameter)."""
        if id(p) not in self._files:
            if self._dir is None:  # removed with the optimizer
                self._dir = Path(tempfile.mkdtemp(prefix="plait-nvme-"))
                weakref.finalize(self, shutil.rmtree, self._dir, True)
            self._dir.mkdir(parents=True, exist_ok=True)
            f = StateFile(self._dir / f"state-{self._order[id(p)]}.npy", local(p).numel())
            f.row("master").copy_(local(p).detach().reshape(-1))
            f.map.flush()
            self._files[id(p)] = f
        return self._files[id(p)]

    def _master(self, p: Tensor) -> Tensor:
        """`p`'s fp32 master copy in host memory (made on first use from the parameter)."""
        if id(p) not in self._masters:
            self._masters[id(p)] = local(p).detach().to("cpu", torch.float32, copy=True).reshape(-1)
        return self._masters[id(p)]

    def offload_gradients(self) -> None:
        """Copy each hosted parameter's gradient shard to the host (fp32; to its file under nvme) and drop it
        on the device."""
        for p in self._hosted_params():
            if p.grad is None:
                continue
            g = local(p.grad).detach().reshape(-1)
            self.meter.to_host += g.numel() * g.element_size()
            if self._nvme(p):
                f = self._file(p)
                f.row("grad").copy_(g)
                f.map.flush()
                self.meter.nvme_written += g.numel() * 4
            else:
                self._grads[id(p)] = g.to("cpu", torch.float32, copy=True)
            self._grads.setdefault(id(p), torch.empty(0))  # marks a gradient this step
            p.grad = None

    def _hosted_params(self) -> list[Tensor]:
        return [p for group in self.param_groups for p in group["params"] if id(p) in self.hosted]

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        self.offload_gradients()  # the device's AdamW below skips them (no gradient)
        resident = torch.optim.AdamW.step  # torch wraps it with the step hooks, which already ran around this
        loss = (resident.__wrapped__ if getattr(resident, "hooked", False) else resident)(self, closure)
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in self._grads:
                    self._step_one(p, group)
        self._grads.clear()
        return loss

    def _step_one(self, p: Tensor, group: dict) -> None:
        """AdamW on the CPU over `p`'s master shard, then the updated shard back to the device."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
        if self._nvme(p):
            f = self._file(p)
            if "exp_avg" not in state:
                self._point_at(p, f)
            rows = f.read()  # the file's rows are the state (`_point_at`)
            self.meter.nvme_read += f.nbytes
            master, grad, exp_avg, exp_avg_sq = rows.unbind(0)
        else:
            master, grad = self._master(p), self._grads[id(p)]
            if "exp_avg" not in state:
                state["exp_avg"] = like(p, torch.zeros_like(local(p), device="cpu"))
                state["exp_avg_sq"] = like(p, torch.zeros_like(local(p), device="cpu"))
            exp_avg, exp_avg_sq = (local(state[name]).view(-1) for name in ("exp_avg", "exp_avg_sq"))
        beta1, beta2 = group["betas"]
        adamw([master], [grad], [exp_avg], [exp_avg_sq], [], [state["step"]], foreach=False, amsgrad=False,
              beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
              maximize=False)
        if self._nvme(p):
            f.write(rows)
            self.meter.nvme_written += f.nbytes
        target = local(p)
        target.copy_(master.view(target.shape))
        self.meter.to_device += target.numel() * target.element_size()

    def _point_at(self, p: Tensor, f: StateFile) -> None:
        """Make `p`'s moments in `state` the file's rows (what checkpoints save between steps)."""
        shape = local(p).shape
        for name in ("exp_avg", "exp_avg_sq"):
            self.state[p][name] = like(p, f.row(name).view(shape))

    def _after_load(self) -> None:
        """After a checkpoint's state was loaded (`load_state_dict` puts it where the parameters are): masters
        again from the loaded parameters, the moments back in host memory or in the state files."""
        self._masters.clear()
        for p in self._hosted_params():
            state = self.state.get(p)
            if not state or "exp_avg" not in state:
                continue
            if self._nvme(p):
                f = self._file(p)
                f.row("master").copy_(local(p).detach().reshape(-1))
                for name in ("exp_avg", "exp_avg_sq"):
                    f.row(name).copy_(local(state[name]).reshape(-1))
                f.map.flush()
                self._point_at(p, f)
            else:
                for name in ("exp_avg", "exp_avg_sq"):
                    state[name] = like(p, local(state[name]).to("cpu", torch.float32, copy=True))

    def take_meter(self) -> OffloadMeter:
        """This step's bytes, and a fresh meter for the next."""
        meter, self.meter = self.meter, OffloadMeter()
        return meter


def step_metrics(optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, float] | None:
    """The `offload` entry of a step's metrics over a rank's optimizers (bytes; None without a hosted one)."""
    meters = [o.take_meter() for o in optimizers if isinstance(o, HostAdamW) and o.hosted]
    if not meters:
        return None
    return {k: sum(m.as_dict()[k] for m in meters) for k in meters[0].as_dict()}


def hosted_params(model: nn.Module, chunk: Chunk) -> dict[int, str]:
    """id -> offload choice of the parameters of `model` (chunk `chunk`, parallelised) whose optimizer steps
    on the host: the layers of each segment with a `HOSTED` choice, the embedding with the first segment's
    and the head with the last's (as `plait.runtime.parallelize.parallelize_chunk` assigns them)."""
    out: dict[int, str] = {}
    segments = chunk.segments
    for k, seg in enumerate(segments):
        if seg.strategy.offload not in HOSTED:
            continue
        modules = [model.layers[str(i)] for i in range(*seg.layers) if str(i) in model.layers]
        if k == 0:
            modules += [m for m in (model.tok_embeddings, model.pos_embeddings) if m is not None]
        if k == len(segments) - 1:
            modules += model.head_modules
        for module in modules:
            for p in module.parameters():
                out.setdefault(id(p), seg.strategy.offload)
    return out
