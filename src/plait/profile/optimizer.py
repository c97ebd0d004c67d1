"""Measure the once-per-step work after the backward: gradient clipping, the AdamW step, zeroing gradients.

On one rank, in this process, for parameter sets of the model's size (its embedding, head and 1, 2, ...
blocks), as the runtime runs it (`plait.runtime.train.clip_grads`, the AdamW of
`plait.runtime.optim.make_optimizer` in its default multi-tensor implementation); fitted as seconds =
intercept + per_param * parameters. On the CPU the clock is the thread's CPU time, as for the layers. Units:
seconds, parameters.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import numpy as np
from scipy.optimize import nnls

from plait.cost.profile_file import OptimizerCurve
from plait.spec.model import ModelSpec

BLOCKS = (1, 2, 4)
"""Blocks of the measured models (besides embedding and head)."""
WARMUP, REPEATS = 2, 9
QUICK_REPEATS = 5


def measure_optimizer(spec: ModelSpec, quick: bool = False, dtype: str = "fp32") -> OptimizerCurve:
    """Seconds of one step's clipping + AdamW step + zero_grad as a function of the rank's parameters (held,
    with their gradients and moments, in `dtype`)."""
    import torch

    from plait.models import build_model
    from plait.profile.layers import TORCH_DTYPES, _clock, _device, _measurement_settings, _sync
    from plait.runtime.optim import PROFILE_LR, make_optimizer
    from plait.runtime.train import clip_grads

    device = _device()
    clock = _clock(device)
    samples = []
    with _measurement_settings():
        for blocks in BLOCKS:
            model = build_model(_first_layers(spec, blocks), device=device, seed=0, dtype=TORCH_DTYPES[dtype])
            params = list(model.parameters())
            optimizer = make_optimizer(params, PROFILE_LR)
            seconds = []
            for rep in range(WARMUP + (QUICK_REPEATS if quick else REPEATS)):
                for p in params:
                    p.grad = torch.full_like(p, 1e-3)
                _sync(device)
                start = clock()
                clip_grads(params, 1.0, None)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                _sync(device)
                if rep >= WARMUP:
                    seconds.append(clock() - start)
            samples.append((float(sum(p.numel() for p in params)), statistics.median(seconds)))
    return fit_optimizer(samples)


def _first_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """`spec` cut to its first `layers` layers (its own layer shapes, in order)."""
    return replace(spec, mixed=spec.mixed[:layers]) if spec.mixed else replace(spec, layers=layers)


def fit_optimizer(samples: list[tuple[float, float]]) -> OptimizerCurve:
    """seconds = intercept + per_param * parameters through (parameters, seconds) samples, both >= 0."""
    x = np.array([[1.0, n] for n, _ in samples])
    scale = np.maximum(x.max(axis=0), 1e-30)
    coef, _ = nnls(x / scale, np.array([t for _, t in samples]))
    intercept, per_param = (float(c) for c in coef / scale)
    return OptimizerCurve(intercept_s=intercept, per_param_s=per_param, samples=tuple(samples))
