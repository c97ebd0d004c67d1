"""Scalability curves: the seconds one layer of a MetaOp takes on n devices, from plait's cost model.

A `Curve` keeps the valid device counts at which an op gets faster (each strictly faster than every smaller
count) and its seconds per layer there. Between them the rate (layers per second) is interpolated linearly
from (0 devices, 0 layers/s), as Spindle interpolates speed-ups: this is the curve the continuous allocator
inverts. At an integer count that is not valid an op runs on the largest valid count below it.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from plait.cost.calibration import Calibration, calibration_for
from plait.cost.compute import gemm_time
from plait.cost.layer import BlockContext
from plait.cost.memory import model_state_bytes
from plait.cost.precision import PRECISIONS, PrecisionBytes
from plait.cost.price import price, usable_memory
from plait.errors import PlaitError
from plait.planner.multitask.graph import MetaOp
from plait.planner.space import SpaceLimits, block_strategies, divisors
from plait.plan import Strategy
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class Curve:
    """Seconds per layer (`layer_s`) at valid device counts (`counts`, ascending, each strictly faster)."""

    counts: tuple[int, ...]
    layer_s: tuple[float, ...]
    strategies: tuple[Strategy, ...] = field(default=(), compare=False)
    """The strategy of each count (empty for curves not priced from strategies, e.g. `amdahl`)."""

    @staticmethod
    def of(points: Iterable[tuple[int, float]]) -> Curve:
        """The curve through (count, seconds per layer) points, less infinite and dominated ones."""
        counts: list[int] = []
        times: list[float] = []
        for n, t in sorted(points):
            if math.isfinite(t) and (not times or t < times[-1]):
                counts.append(n)
                times.append(t)
        return Curve(tuple(counts), tuple(times))

    @staticmethod
    def amdahl(seconds: float, serial: float, counts: Sequence[int]) -> Curve:
        """Amdahl's law per layer: `seconds` on one device, a fraction `serial` that does not scale."""
        return Curve.of((n, seconds * (serial + (1 - serial) / n)) for n in counts)

    @property
    def empty(self) -> bool:
        return not self.counts

    @cached_property
    def _rates(self) -> tuple[float, ...]:
        return (0.0, *(1 / t for t in self.layer_s))

    @cached_property
    def _points(self) -> tuple[int, ...]:
        return (0, *self.counts)

    def usable(self, devices: int) -> int:
        """The largest valid count up to `devices` (0 if none)."""
        i = bisect_right(self.counts, devices)
        return self.counts[i - 1] if i else 0

    def strategy(self, devices: int) -> Strategy | None:
        """The strategy the op runs with on `devices` devices (that of the largest valid count up to it;
        None when the curve has no strategies or no count fits)."""
        n = self.usable(devices)
        return self.strategies[self.counts.index(n)] if n and self.strategies else None

    def seconds(self, devices: int, layers: float) -> float:
        """Seconds of `layers` layers on `devices` devices (the largest valid count up to it); inf if none."""
        n = self.usable(devices)
        return layers * self.layer_s[self.counts.index(n)] if n else math.inf

    def next_count(self, devices: int) -> int | None:
        """The smallest valid count above `devices`, None above the largest."""
        i = bisect_right(self.counts, devices)
        return self.counts[i] if i < len(self.counts) else None

    def bracket(self, devices: float) -> tuple[int, int]:
        """Adjacent valid counts (or 0 below the first) around a fractional count: n1 <= devices <= n2."""
        i = bisect_right(self._points, devices)
        if i and self._points[i - 1] == devices:
            return int(devices), int(devices)
        return self._points[i - 1], self._points[min(i, len(self._points) - 1)]

    def rate(self, devices: float) -> float:
        """Layers per second on a fractional count (linear between valid counts, 0 at 0)."""
        n1, n2 = self.bracket(devices)
        r1, r2 = self._rates[self._points.index(n1)], self._rates[self._points.index(n2)]
        return r2 if n1 == n2 else r1 + (r2 - r1) * (devices - n1) / (n2 - n1)

    def devices(self, layers: float, seconds: float) -> float:
        """Fractional devices that run `layers` layers in `seconds` (inverse of `rate`); inf if too fast."""
        need = layers / seconds
        k = bisect_right(self._rates, need)
        if k == len(self._rates):
            return self.counts[-1] if need == self._rates[-1] else math.inf
        r1, r2 = self._rates[k - 1], self._rates[k]
        n1, n2 = self._points[k - 1], self._points[k]
        return n1 + (n2 - n1) * (need - r1) / (r2 - r1)


@dataclass(frozen=True)
class Pricing:
    """What pricing an op needs besides the op: the cluster, calibration, precision and search space."""

    cluster: Cluster
    cal: Calibration
    prec: PrecisionBytes
    limits: SpaceLimits = SpaceLimits()

    @staticmethod
    def for_cluster(cluster: Cluster, precision: str = "bf16", limits: SpaceLimits = SpaceLimits()) -> Pricing:
        return Pricing(cluster, calibration_for(cluster.gpu.name), PRECISIONS[precision], limits)


def op_model(op: MetaOp) -> ModelSpec:
    """The op as a model of its layers alone (the pricing context's model; no embedding or head)."""
    b = op.block
    return ModelSpec(name=op.name, family="gpt", layers=op.layers, hidden=b.hidden, heads=max(b.heads, 1),
                     head_dim=b.head_dim or 0, vocab=1, mixed=(b,) * op.layers)


def projection_cost(op: MetaOp, s: Strategy, sequences: int, p: Pricing) -> tuple[float, float]:
    """(seconds, bytes) on one device of the projections into `op`'s width (`MetaOp.project_from`) for one
    micro-batch of `sequences` samples under `s`: each a Linear(h_in, h_out) the runtime runs whole on every
    rank of the group on its piece of the tokens (2 tokens h_in h_out FLOPs forward, twice that backward);
    its weights, gradients and optimizer state unsharded."""
    if not op.project_from:
        return 0.0, 0.0
    gpu, eb, h = p.cluster.gpu, p.prec.activation, op.block.hidden
    peak = p.prec.peak_flops(gpu)
    tokens = sequences * op.block.seq(op.seq_len) // (s.cp * (s.tp if s.sp else 1))
    seconds = sum(gemm_time(tokens, h, w, gpu, p.cal, peak, eb)  # forward; backward: input and weight grads
                  + gemm_time(tokens, w, h, gpu, p.cal, peak, eb)
                  + gemm_time(w, h, tokens, gpu, p.cal, peak, eb) for w in op.project_from)
    params = sum(w * h + h for w in set(op.project_from))
    return seconds, sum(model_state_bytes(params, 1, 0, p.prec))


def _strategy_seconds(op: MetaOp, model: ModelSpec, s: Strategy, devices: int, p: Pricing) -> float:
    """Seconds per layer of `op` under `s` on `devices` ranks, accumulating gradients over the fewest
    micro-batches whose activations fit in memory; inf if none fits. The op's input projections
    (`projection_cost`) are spread over its layers."""
    ranks = tuple(range(devices))
    per_replica = op.batch // s.dp
    capacity = usable_memory(p.cluster.gpu.memory_bytes, p.cal)
    for m in divisors(per_replica):
        ctx = BlockContext.for_ranks(model, p.cluster, p.cal, p.prec, op.seq_len, per_replica // m, s, ranks,
                                     s.degrees.group(ranks, "data"))
        c = price(op.block, s, ctx)
        project_s, project_bytes = projection_cost(op, s, per_replica // m, p)
        if op.layers * (c.states + c.activation) + c.working + c.buffers + project_bytes <= capacity:
            return m * (c.micro_batch_s + project_s / op.layers) + c.exposed_sync(p.cal.overlap_efficiency)
    return math.inf


def layer_seconds(op: MetaOp, devices: int, p: Pricing) -> tuple[float, Strategy | None]:
    """The fastest strategy for one layer of `op` on `devices` devices (data, tensor and context parallel,
    ZeRO, recompute), its seconds per layer per step; (inf, None) if none fits."""
    model = op_model(op)
    best: tuple[float, Strategy | None] = (math.inf, None)
    for s in block_strategies(op.block, p.cluster, devices, op.batch, op.seq_len, p.limits):
        t = _strategy_seconds(op, model, s, devices, p)
        if t < best[0]:
            best = (t, s)
    return best


def op_curve(op: MetaOp, counts: Sequence[int], p: Pricing) -> Curve:
    """The op's scalability curve over `counts`."""
    priced = {n: layer_seconds(op, n, p) for n in counts}
    curve = Curve.of((n, t) for n, (t, _) in priced.items())
    curve = replace(curve, strategies=tuple(priced[n][1] for n in curve.counts))
    if curve.empty:
        raise PlaitError(f"{op.name} ({op.layers} {op.block.kind} layers, batch {op.batch}) fits on no group of "
                         f"{', '.join(map(str, counts))} {p.cluster.gpu.name} devices; lower the task's batch")
    return curve


def curves(ops: Sequence[MetaOp], cluster: Cluster, p: Pricing, progress: Progress | None = None) -> list[Curve]:
    """Scalability curves of `ops` over the divisors of the cluster's device count (ops with the same
    layer, batch and sequence length priced once)."""
    counts = divisors(cluster.world_size)
    cache: dict[MetaOp, Curve] = {}
    out = []
    for i, op in enumerate(ops):
        key = replace(op, name="", task="", module="")
        if key not in cache:
            cache[key] = op_curve(op, counts, p)
        out.append(cache[key])
        if progress:
            progress("pricing ops", i + 1, len(ops))
    return out
