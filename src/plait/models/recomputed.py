"""An attention core that keeps only its inputs for backward and runs again there: Megatron-LM's selective
recomputation (Korthikanti et al. 2022, sec. 4: `CheckpointFunction` around `core_attention`).

`recomputed(core, q, k, v)` returns `core(q, k, v)` (and passes further inputs on, such as attention sinks);
for backward it saves its inputs alone (through the
saved-tensor hooks, so a swap cuts and meters them like every kept activation) and none of the core's own
tensors (a fused kernel's log-sum-exp, an eager core's scores, softmax and dropout mask), and in backward runs
the core again from them, under the random state of its forward (the same dropout mask), to differentiate it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Core = Callable[..., Tensor]
"""An attention core: queries, keys, values [B, heads, T, D] (and the heads' sinks [heads], if any) -> output
[B, heads, T, D]."""


class _Recomputed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core: Core, *inputs: Tensor) -> Tensor:  # noqa: ANN001
        ctx.core = core
        ctx.cpu_state = torch.get_rng_state()
        ctx.device_state = torch.cuda.get_rng_state() if inputs[0].is_cuda else None
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return core(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # noqa: ANN001
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        devices = [inputs[0].device] if ctx.device_state is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            torch.set_rng_state(ctx.cpu_state)
            if ctx.device_state is not None:
                torch.cuda.set_rng_state(ctx.device_state)
            out = ctx.core(*inputs)
        grads = iter(torch.autograd.grad(out, [t for t in inputs if t.requires_grad], grad))
        return None, *(next(grads) if t.requires_grad else None for t in inputs)


def recomputed(core: Core, *inputs: Tensor) -> Tensor:
    """`core(*inputs)` with only its inputs kept for backward, where the core runs again (see the module; also
    the experts' activation under Megatron-LM's `moe_act` recompute, `plait.models.moe`)."""
    return _Recomputed.apply(core, *inputs)
