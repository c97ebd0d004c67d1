"""The profile file: what `plait profile` measured on one device type, in a versioned JSON schema.

Units: seconds, bytes, bytes/s. Every curve keeps the samples it was fitted to, so a reader can check the
fit. A profile applies to one device type (`device.gpu_type`) and never silently to another.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from plait.errors import PlaitError
from plait.io import write_atomically

PROFILE_VERSION = 1

CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]
StrategyKind = Literal["none", "tp", "tp_sp", "cp", "zero3", "ep"]
ProfileDtype = Literal["fp32", "bf16"]
PROFILE_ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes of one element of each dtype a profile measures in."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Device(_Frozen):
    """Where the profile was measured."""

    kind: Literal["cpu", "cuda"]
    gpu_type: str = Field(description="the cluster device type it applies to, e.g. CPU or H100-80GB")
    name: str = Field(description="what the hardware calls itself (CPU model, CUDA device name)")
    threads: int = Field(1, ge=1, description="compute threads per rank")
    cores: int = Field(1, ge=1, description="CPU cores the ranks of a node share (CPU only: more ranks than "
                                            "cores share them)")
    memory_bytes: float = Field(gt=0, description="memory per rank the planner may use")
    peak_flops: float = Field(gt=0, description="FLOP/s of a large GEMM on one rank, in the profile's dtype")
    memory_bandwidth: float = Field(gt=0, description="bytes/s of a large copy on one rank")
    torch: str = Field(description="torch version")


class Curve(_Frozen):
    """seconds = intercept_s + per_token_s * tokens + per_token_seq_s * tokens * seq_len (the last term is
    attention's quadratic part), for one micro-batch on one device."""

    intercept_s: float = 0.0
    per_token_s: float = 0.0
    per_token_seq_s: float = 0.0

    def at(self, tokens: float, seq_len: float) -> float:
        return max(0.0, self.intercept_s + self.per_token_s * tokens + self.per_token_seq_s * tokens * seq_len)


class LayerSample(_Frozen):
    """One measurement of a transformer block (or the embedding/head): a micro-batch of `seqs` sequences of
    `seq_len` tokens."""

    seqs: int
    seq_len: int
    forward_s: float
    backward_s: float
    activation_bytes: float = Field(description="bytes saved for backward")


class LayerProfile(_Frozen):
    """A block of `model` with its weights split `tp` ways (heads/tp, ffn/tp), as a function of tokens; a
    mixture-of-experts layer also `ep` ways (its experts/ep local experts take the rank's routed tokens)."""

    model: str
    tp: int = 1
    shape: str = Field("", description="the measured layer's `Block.fingerprint`; empty for the model's "
                                       "trunk decoder layer")
    ep: int = Field(1, ge=1, description="expert-parallel shard of an MoE layer (experts/ep local)")
    recompute: Literal["none", "selective", "full"] = "none"
    forward: Curve
    backward: Curve
    activation_bytes_per_token: float = Field(description="bytes saved for backward per token")
    samples: tuple[LayerSample, ...] = ()


class EdgeProfile(_Frozen):
    """The embedding ("embedding") or final norm + LM head + loss ("head") of `model`, measured as the
    difference between models of different layer counts."""

    model: str
    part: Literal["embedding", "head"]
    tp: int = 1
    forward: Curve
    backward: Curve
    samples: tuple[LayerSample, ...] = ()


class OptimizerCurve(_Frozen):
    """seconds = intercept_s + per_param_s * parameters for one training step's clipping, optimizer step
    and zeroing of gradients over one rank's parameters (AdamW, as the runtime runs it)."""

    intercept_s: float = 0.0
    per_param_s: float = 0.0
    samples: tuple[tuple[float, float], ...] = Field((), description="(parameters, seconds)")

    def at(self, params: float) -> float:
        return max(0.0, self.intercept_s + self.per_param_s * params)


class StrategyProfile(_Frozen):
    """One block of `model` as the runtime runs it under one parallel strategy over `group` ranks, while
    `ranks` ranks of the node are busy (groups side by side): wall seconds, communication and the runtime's
    own overhead included, for the micro-batch of one data-parallel replica (see
    plait.profile.strategy_blocks)."""

    model: str
    kind: StrategyKind = Field(description="tp, tp_sp (with sequence parallelism), cp (Ulysses), zero3 (FSDP), "
                                           "ep (expert parallelism of an MoE layer), none (a plain block on "
                                           "each busy rank)")
    group: int = Field(ge=1, description="ranks of the tensor-, context-, data- or expert-parallel group "
                                         "(1 for none)")
    shape: str = Field("", description="the fingerprint of the layer timed (`Block.fingerprint`): an MoE "
                                       "layer for ep; empty for the model's trunk decoder layer")
    ranks: int = Field(ge=2, description="ranks busy at once on the node while measured")
    forward: Curve
    backward: Curve
    samples: tuple[LayerSample, ...] = ()
    embedding: EdgeProfile | None = Field(None, description="the embedding under the same strategy")
    head: EdgeProfile | None = Field(None, description="final norm, LM head and loss under the same strategy")
    optimizer: OptimizerCurve | None = Field(None, description="clipping + AdamW + zeroing of parameters "
                                                               "laid out by this strategy")


class CollectiveSample(_Frozen):
    bytes: float = Field(description="bytes per rank (the input of all-reduce/reduce-scatter/all-to-all, "
                                     "the output of all-gather, the message of p2p)")
    seconds: float


class CollectiveCurve(_Frozen):
    """seconds = latency_s + bytes / bandwidth for one collective over `ranks` ranks on `nodes` nodes."""

    op: CollectiveOp
    ranks: int = Field(ge=2)
    nodes: int = Field(1, ge=1)
    latency_s: float = Field(ge=0)
    bandwidth: float = Field(gt=0, description="bytes/s of the per-rank size")
    samples: tuple[CollectiveSample, ...] = ()

    def at(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


class Overlap(_Frozen):
    """How much compute and communication slow each other down when they run at the same time."""

    compute_slowdown: float = Field(1.0, ge=1.0, description="compute time overlapped / alone")
    comm_slowdown: float = Field(1.0, ge=1.0, description="communication time overlapped / alone")


class Profile(_Frozen):
    """Everything measured on one device type."""

    version: int = PROFILE_VERSION
    dtype: ProfileDtype = Field("fp32", description="what the layers, the optimizer step and the strategies "
                                                    "were measured in: fp32, or bf16 weights and activations")
    device: Device
    process_bytes: float = Field(0.0, ge=0, description="memory of a rank before any model state: the "
                                                        "interpreter and libraries (CPU) or the CUDA context")
    layers: tuple[LayerProfile, ...] = ()
    edges: tuple[EdgeProfile, ...] = ()
    collectives: tuple[CollectiveCurve, ...] = ()
    overlap: Overlap = Overlap()
    strategies: tuple[StrategyProfile, ...] = ()
    optimizer: OptimizerCurve | None = None

    def save(self, path: str | Path) -> None:
        write_atomically(Path(path), self.model_dump_json(indent=1) + "\n")


def load_profile(path: str | Path) -> Profile:
    """Read a profile; one-line errors for a missing, corrupt, or newer-versioned file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise PlaitError(f"cannot read profile {str(path)!r}: {exc.strerror}; run `plait profile` first") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PlaitError(f"profile {str(path)!r} is not valid JSON; re-run `plait profile`") from None
    if not isinstance(raw, dict):
        raise PlaitError(f"profile {str(path)!r} is not a profile object; re-run `plait profile`")
    version = raw.get("version")
    if version != PROFILE_VERSION:
        raise PlaitError(f"profile {str(path)!r} has schema version {version!r}; this plait reads version "
                         f"{PROFILE_VERSION}: re-run `plait profile`")
    try:
        return Profile.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise PlaitError(f"profile {str(path)!r}: {where}: {err['msg']}; re-run `plait profile`") from None
