"""Distributed checkpoints (DCP): save every K steps, resume under any plan.

Model and optimizer state are saved by fully qualified parameter name (the full model's names, whatever
the plan's stages, shards and wrappers), so DCP reshards them on load: a checkpoint written with
tp=2, pp=2 resumes with dp=4. A checkpoint directory appears only when complete (written under a
temporary name, renamed by rank 0 after every rank finished).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from plait.errors import PlaitError

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def _state(chunks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list[tuple]]:
    """The merged state of every chunk and each chunk's own keys."""
    model_sd: dict = {}
    optim_sd: dict = {}
    keys = []
    for m, o in zip(chunks, optimizers):
        ms, os_ = get_state_dict(m, o, options=_OPTIONS)
        model_sd.update(ms)
        optim_sd.update(os_)
        keys.append((set(ms), set(os_)))
    return {"model": model_sd, "optim": optim_sd}, keys


def latest(directory: str | Path) -> tuple[int, Path] | None:
    """(step, path) of the newest complete checkpoint in `directory`, or None."""
    root = Path(directory)
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        meta = path / "plait.json"
        if meta.is_file():
            try:
                found.append((int(json.loads(meta.read_text())["step"]), path))
            except (ValueError, KeyError, json.JSONDecodeError):
                raise PlaitError(f"checkpoint {str(path)!r} is corrupt (unreadable plait.json); delete it or "
                                 "give another --checkpoint-dir") from None
    return max(found) if found else None


def save(directory: str | Path, step: int, chunks: list[torch.nn.Module],
         optimizers: list[torch.optim.Optimizer]) -> Path:
    """Save after `step` optimizer steps (collective over every rank)."""
    root = Path(directory)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state, _ = _state(chunks, optimizers)
    dcp.save(state, checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "plait.json").write_text(json.dumps({"step": step}))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


_TIED = ("output.weight", "tok_embeddings.weight")
"""A head tied to the embedding is saved once under the embedding's name by a plan that keeps both on one
stage; a plan that splits them onto two stages reads the head's copy from there."""


def _names(state: dict, path: Path) -> dict[tuple[str, str], str]:
    """The checkpoint key to read each (section, key) of `state` from: itself, or its tied alias when the
    checkpoint lacks it."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    names = {}
    for top, entries in state.items():
        for key in entries:
            alias = key.replace(*_TIED)
            names[top, key] = alias if alias != key and f"{top}.{key}" not in saved else key
    return names


def load(path: Path, chunks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """Load a checkpoint into this rank's chunks and optimizers, resharding to the current plan."""
    state, keys = _state(chunks, optimizers)
    try:
        names = _names(state, path)
        request = {top: {names[top, k]: v for k, v in entries.items()} for top, entries in state.items()}
        dcp.load(request, checkpoint_id=str(path))
    except Exception as exc:  # noqa: BLE001 -- DCP raises many types for missing or mismatched files
        raise PlaitError(f"cannot load checkpoint {str(path)!r}: {str(exc).splitlines()[0][:200]}; is it a "
                         "checkpoint of this model?") from None
    for (top, key), name in names.items():  # tensors were filled in place; other values were replaced
        state[top][key] = request[top][name]
    for m, o, (model_keys, optim_keys) in zip(chunks, optimizers, keys):
        set_state_dict(m, o, model_state_dict={k: state["model"][k] for k in model_keys},
                       optim_state_dict={k: state["optim"][k] for k in optim_keys}, options=_LOAD_OPTIONS)
