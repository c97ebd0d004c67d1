"""The one optimizer the runtime trains with, and the profiler times: AdamW with Megatron's GPT settings."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from plait.runtime.offload import HostAdamW

ADAM_BETAS = (0.9, 0.95)
"""AdamW (beta1, beta2) of Megatron-LM's GPT-3 and Llama recipes."""
WEIGHT_DECAY = 0.1
"""Decoupled weight decay of those recipes."""
PROFILE_LR = 1e-4
"""Learning rate of the steps the profiler times (the value does not change their cost)."""


def make_optimizer(params: Iterable[torch.nn.Parameter], lr: float, hosted: dict[int, str] | None = None,
                   nvme_dir: Path | None = None) -> torch.optim.Optimizer:
    """AdamW over `params` with learning rate `lr` and the settings above; the `hosted` ones (id -> offload
    choice) step on the host CPU, their states in host memory or in files under `nvme_dir`
    (`plait.runtime.offload.HostAdamW`)."""
    if not hosted:
        return torch.optim.AdamW(params, lr=lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY)
    return HostAdamW(params, hosted, nvme_dir, lr=lr, betas=ADAM_BETAS, weight_decay=WEIGHT_DECAY)
