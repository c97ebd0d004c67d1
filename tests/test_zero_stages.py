"""What each ZeRO stage keeps between the micro-batches of a step (`plait.runtime.zero`), on 2 gloo ranks:
after a backward that is not the step's last, ZeRO-2/3 units have reduce-scattered their gradients (a
sharded gradient, no whole one) and ZeRO-3 units have freed their gathered parameters; ZeRO-1 units hold
the whole gradient and the gathered parameters until the last micro-batch. The same through the switches
torch's pipeline stages flip (`follow_zero_stages`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ranks_command

WORLD = 2


def _state(unit) -> dict:
    """Whether `unit`'s weight is gathered (a plain tensor) and what gradient its FSDP parameter holds."""
    from torch.distributed.tensor import DTensor

    fsdp_param = unit._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    gathered = not isinstance(unit.weight, DTensor)
    sharded_grad = fsdp_param.sharded_param.grad is not None
    whole = fsdp_param.unsharded_accumulated_grad is not None or (
        hasattr(fsdp_param, "_unsharded_param") and fsdp_param._unsharded_param.grad is not None)
    return {"gathered": gathered, "sharded_grad": sharded_grad, "whole_grad": whole}


def _worker(out_file: str) -> None:
    """Under torchrun with WORLD ranks: each stage's state after one backward, written by rank 0."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from plait.runtime.zero import follow_zero_stages, micro_batch_flags, shard_unit

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    result = {}
    for via in ("loop", "pipeline"):
        for zero in (1, 2, 3):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
            for layer in model:
                shard_unit(layer, mesh, zero)
            shard_unit(model, mesh, zero)
            if via == "pipeline":
                follow_zero_stages(model)
                model.set_reshard_after_backward(False)  # as torch's PipelineStage does before a backward
                model.set_requires_gradient_sync(False)  # that is not the step's last
            else:
                micro_batch_flags(model, last=False)
            model(torch.randn(4, 8)).sum().backward()
            result[f"{via} zero{zero}"] = _state(model[0])
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(result, f)
    dist.barrier()  # neither rank leaves while the other still talks to it
    # Return without tearing the process group down: the launcher's forked rank then leaves without the
    # interpreter's teardown, where under load a gloo helper thread can still be joinable, which aborts the rank
    # ("terminate called without an active exception") after its work is done and reported.


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero") / "out.json"
    cmd = ranks_command(WORLD, __file__, str(out))
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(out).read_text())


@pytest.mark.parametrize("via", ["loop", "pipeline"])
def test_between_micro_batches_each_stage_keeps_what_it_promises(states, via) -> None:
    assert states[f"{via} zero1"] == {"gathered": True, "sharded_grad": False, "whole_grad": True}
    assert states[f"{via} zero2"] == {"gathered": True, "sharded_grad": True, "whole_grad": False}
    assert states[f"{via} zero3"] == {"gathered": False, "sharded_grad": True, "whole_grad": False}


if __name__ == "__main__":
    _worker(sys.argv[1])
