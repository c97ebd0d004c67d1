"""An attention core that keeps only its inputs for backward and runs again there: Megatron-LM's selective
recomputation (Korthikanti et al. 2022, sec. 4: `CheckpointFunction` around `core_attention`).

`recomputed(core, q, k, v)` returns `core(q, k, v)`; for backward it saves q, k and v alone (through the
saved-tensor hooks, so a swap cuts and meters them like every kept activation) and none of the core's own
tensors (a fused kernel's log-sum-exp, an eager core's scores, softmax and dropout mask), and in backward runs
the core again from them, under the random state of its forward (the same dropout mask), to differentiate it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Core = Callable[[Tensor, Tensor, Tensor], Tensor]
"""An attention core: queries, keys, values [B, heads, T, D] -> output [B, heads, T, D]."""


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core: Core, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # noqa: ANN001
        ctx.core = core
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = torch.cuda.get_rng_state() if q.is_cuda else None
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return core(q, k, v)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[None, Tensor, Tensor, Tensor]:  # noqa: ANN001
        q, k, v = (t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors)
        devices = [q.device] if ctx.device_state is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            if ctx.device_state is not None:
                torch.cuda.set_rng_state(ctx.device_state)
            out = ctx.core(q, k, v)
        inputs = [t for t in (q, k, v) if t.requires_grad]
        grads = iter(torch.autograd.grad(out, inputs, grad))
        return None, *(next(grads) if t.requires_grad else None for t in (q, k, v))  # type: ignore[return-value]


def recomputed(core: Core, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`core(q, k, v)` with only q, k and v kept for backward, where the core runs again (see the module)."""
    return _Recomputed.apply(core, q, k, v)
