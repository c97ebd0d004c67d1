"""Distributed checkpoints (DCP): save every K steps, resume under any plan.

Model and optimizer state are saved by fully qualified parameter name (the full model's names, whatever
the plan's stages, shards and wrappers), so DCP reshards them on load: a checkpoint written with
tp=2, pp=2 resumes with dp=4. A checkpoint directory appears only when complete (written under a
temporary name, renamed by rank 0 after every rank finished); a failed save removes its partial files and
leaves the earlier checkpoints as they were. Each checkpoint records the model's fingerprint, checked on
resume; a checkpoint that cannot be read is skipped for the newest one that can.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from plait.errors import PlaitError
from plait.io import write_atomically
from plait.spec.model import ModelSpec

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LOAD_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def local_state(chunks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> tuple[dict, list[tuple]]:
    """This rank's merged state of every chunk ({"model": ..., "optim": ...} by fully qualified name, DTensor
    shards as they are) and each chunk's own keys (with the optimizer that names its state). An optimizer
    that steps slices of ZeRO across pipelines shows its whole moments, gathered from the slices' holders
    (`plait.runtime.replica_zero.whole_view`, collective)."""
    from plait.runtime.replica_zero import whole_view

    model_sd: dict = {}
    optim_sd: dict = {}
    keys = []
    for m, o in zip(chunks, optimizers):
        view = whole_view(m, o)
        ms, os_ = get_state_dict(m, view, options=_OPTIONS)
        model_sd.update(ms)
        optim_sd.update(os_)
        keys.append((set(ms), set(os_), view))
    return {"model": model_sd, "optim": optim_sd}, keys


META = "plait.json"
"""The file that marks a checkpoint complete: its step and the model it holds."""


def _reason(exc: BaseException) -> str:
    """The first line of what went wrong, from DCP's CheckpointException (one entry per failed rank) or
    any other exception."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = next(iter(failures.values()))[0]
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text.split(". ")[0][:200]


def checkpoints(directory: str | Path) -> list[Path]:
    """The checkpoint directories (`step-N`) in `directory`, newest first."""
    root = Path(directory)
    found = [(int(p.name[5:]), p) for p in root.glob("step-*") if p.is_dir() and p.name[5:].isdigit()] \
        if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def read_meta(path: Path) -> dict:
    """The checkpoint's plait.json (PlaitError when missing or unreadable)."""
    try:
        meta = json.loads((path / META).read_text())
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError):
        raise PlaitError(f"checkpoint {str(path)!r} is corrupt (unreadable {META})") from None
    return meta


def problem(path: Path) -> str | None:
    """Why the checkpoint at `path` cannot be read, without loading it (None when it looks whole): its
    plait.json, its DCP .metadata, and every data file at least as long as the metadata says."""
    try:
        read_meta(path)
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except PlaitError:
        return f"its {META} is missing or corrupt"
    except Exception as exc:  # noqa: BLE001 -- a missing or garbled pickle raises many types
        return f"its .metadata is unreadable ({_reason(exc)})"
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            return f"its data file {name} is missing"
        if file.stat().st_size < size:
            return f"its data file {name} is truncated ({file.stat().st_size} of {size} bytes)"
    return None


def check_model(path: Path, model: ModelSpec) -> None:
    """Refuse a checkpoint saved for another architecture (checkpoints without a fingerprint pass)."""
    meta = read_meta(path)
    saved = meta.get("model_fingerprint")
    if saved is not None and saved != model.fingerprint:
        raise PlaitError(f"checkpoint {str(path)!r} holds {meta.get('model', 'another model')}, not {model.name}; "
                         f"give --model {meta.get('model', '...')} or another --checkpoint-dir")


def resumable(directory: str | Path, model: ModelSpec, note: Callable[[str], None]) -> list[Path]:
    """The checkpoints of `directory` that look readable, newest first; `note` gets one line for each one
    skipped. PlaitError when checkpoints exist but none can be read, or they hold another model."""
    found = checkpoints(directory)
    usable = []
    skipped = []
    for path in found:
        why = problem(path)
        if why is None:
            check_model(path, model)
            usable.append(path)
        else:
            skipped.append(f"{path.name}: {why}")
            note(f"skipping checkpoint {str(path)!r}: {why}")
    if found and not usable:
        raise PlaitError(f"no checkpoint in {str(directory)!r} can be read ({'; '.join(skipped)}); delete them or "
                         "give another --checkpoint-dir")
    return usable


def check_resume_from(path: Path, model: ModelSpec) -> None:
    """Refuse a --resume-from that is not a readable checkpoint of `model`."""
    if not path.is_dir():
        raise PlaitError(f"--resume-from {str(path)!r} is not a directory; give a step-N directory of a "
                         "--checkpoint-dir")
    why = problem(path)
    if why is not None:
        raise PlaitError(f"--resume-from {str(path)!r} cannot be read: {why}; give another checkpoint")
    check_model(path, model)


def step_of(path: Path) -> int:
    """The optimizer steps a checkpoint was saved after."""
    return int(read_meta(path)["step"])


def select_params(state: dict, keep: Callable[[str], bool]) -> dict:
    """`local_state`'s state less the entries of parameters `keep` refuses (by fully qualified name): the
    model's own, and the optimizer's (flattened `state.NAME.x` and `param_groups.NAME.x`)."""
    def name(top: str, key: str) -> str:
        return key if top == "model" else key.split(".", 1)[1].rsplit(".", 1)[0]

    return {top: {k: v for k, v in entries.items() if keep(name(top, k))} for top, entries in state.items()}


def save(directory: str | Path, step: int, chunks: list[torch.nn.Module],
         optimizers: list[torch.optim.Optimizer], model: ModelSpec | None = None,
         keep: Callable[[str], bool] | None = None) -> Path:
    """Save after `step` optimizer steps (collective over every rank), recording `model`'s fingerprint;
    with `keep`, this rank writes only the parameters it accepts (by fully qualified name; every parameter
    must be kept by some rank). A failed save removes its partial files and leaves every earlier checkpoint
    as it was (PlaitError)."""
    root = Path(directory)
    final = root / f"step-{step}"
    tmp = root / f".step-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    state, _ = local_state(chunks, optimizers)
    if keep is not None:
        state = select_params(state, keep)
    failure = None
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- CheckpointException is a BaseException
        failure = _reason(exc)
    failure = _first_of_all(failure)
    if dist.get_rank() == 0:
        if failure is None:
            meta = {"step": step} | ({"model": model.name, "model_fingerprint": model.fingerprint} if model else {})
            try:
                write_atomically(tmp / META, json.dumps(meta))
                _replace_dir(tmp, final)
            except (PlaitError, OSError) as exc:
                failure = str(exc)
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    failure = _first_of_all(failure)
    if failure is not None:
        older = [p.name for p in checkpoints(root) if p != final]
        kept = f"the previous checkpoint {older[0]} is intact" if older else "no earlier checkpoint exists"
        raise PlaitError(f"cannot save checkpoint step-{step} in {str(root)!r}: {failure}; {kept}; free space or "
                         "give another --checkpoint-dir")
    return final


def _first_of_all(reason: str | None) -> str | None:
    """The first rank's non-None `reason` (collective: every rank gets the same answer)."""
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((r for r in reasons if r is not None), None)


def _replace_dir(new: Path, final: Path) -> None:
    """Put directory `new` at `final`, replacing what is there only once `new` is in place."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


TABLE_COPIES = ("output.weight", "mtp_embeddings.weight")
"""Copies of the embedding table (`tok_embeddings.weight`): a head tied to it, and the last stage's copy for
multi-token-prediction modules. A plan that keeps one table saves it once under the embedding's name; a plan
that holds a copy on another stage reads it from there when the checkpoint lacks the copy's own."""


def table_alias(key: str) -> str:
    """`key` (a state entry's name) with a copy of the embedding table named as the table itself
    (`TABLE_COPIES`); other keys unchanged."""
    for name in TABLE_COPIES:
        key = key.replace(name, "tok_embeddings.weight")
    return key


def _names(state: dict, path: Path) -> dict[tuple[str, str], str]:
    """The checkpoint key to read each (section, key) of `state` from: itself, or its tied alias when the
    checkpoint lacks it."""
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    names = {}
    for top, entries in state.items():
        for key in entries:
            alias = table_alias(key)
            names[top, key] = alias if alias != key and f"{top}.{key}" not in saved else key
    return names


def load(path: Path, chunks: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
    """Load a checkpoint into this rank's chunks and optimizers, resharding to the current plan."""
    state, keys = local_state(chunks, optimizers)
    try:
        names = _names(state, path)
        request = {top: {names[top, k]: v for k, v in entries.items()} for top, entries in state.items()}
        dcp.load(request, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- DCP raises many types; its own is a BaseException
        raise PlaitError(f"cannot load checkpoint {str(path)!r}: {_reason(exc)}") from None
    for (top, key), name in names.items():  # tensors were filled in place; other values were replaced
        state[top][key] = request[top][name]
    apply_state(state, keys, chunks, optimizers)


def apply_state(state: dict, keys: list[tuple], chunks: list[torch.nn.Module],
                optimizers: list[torch.optim.Optimizer]) -> None:
    """Set each chunk's model and optimizer state from a `local_state` whose values were filled in (a sliced
    optimizer takes its slices of the whole moments, `plait.runtime.replica_zero.load_whole`)."""
    from plait.runtime.replica_zero import load_whole

    for m, o, (model_keys, optim_keys, view) in zip(chunks, optimizers, keys):
        set_state_dict(m, view, model_state_dict={k: state["model"][k] for k in model_keys},
                       optim_state_dict={k: state["optim"][k] for k in optim_keys}, options=_LOAD_OPTIONS)
        load_whole(view, o)
