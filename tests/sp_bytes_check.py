"""Run under torchrun (2 ranks): the bytes per token that layer 0 of a tiny model keeps for backward under
tensor parallelism with sequence parallelism (tp2+sp), as the swap meter counts them on each rank.

Writes {"family dtype mode": bytes per token (rank 0)} (JSON) to the path in argv[1]; tests/test_activation_bytes.py
compares them with the price.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from plait.models import build_model
from plait.runtime import swap
from plait.runtime.parallelize import apply_ac, apply_tp
from plait.spec.model import load_model

SPECS = json.loads(sys.argv[2])
SEQS, SEQ = 2, 48


def kept(spec: str, mode: str, dtype: str, mesh: object) -> float:
    torch.manual_seed(0)
    model = build_model(load_model(spec))
    layers = list(model.layers)
    apply_tp(model, mesh, True, layers, embedding=True, head=True)
    apply_ac(model, mode, layers)
    meter = swap.SwapMeter.of(model)
    swap.attach(model.layers["0"], 0.0, meter, gather=(mesh.size(),))
    tokens = torch.randint(0, load_model(spec).vocab, (SEQS, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        loss = model(tokens).float().logsumexp(-1).mean()
    loss.backward()
    return meter.resident_peak / (SEQS * SEQ)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    out = {f"{family} {dtype} {mode}": kept(spec, mode, dtype, mesh)
           for family, spec in SPECS.items() for dtype in ("fp32", "bf16") for mode in ("none", "selective")}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
