"""The tables that several commands print: a plan's predicted time and memory, and the plan itself."""

from __future__ import annotations

from rich import box
from rich.table import Table

from plait.cli.common import out
from plait.plan import Plan
from plait.simulate import Report
from plait.spec.cluster import Cluster
from plait.spec.model import ModelSpec


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.3f} s"


def ranks_text(ranks: tuple[int, ...]) -> str:
    """Ranks as short ranges, e.g. `0-3,6,8-9`."""
    parts: list[str] = []
    for r in sorted(ranks):
        if parts and r == int(parts[-1].rpartition("-")[2]) + 1:
            head = parts[-1].partition("-")[0]
            parts[-1] = f"{head}-{r}"
        else:
            parts.append(str(r))
    return ",".join(parts)


def print_report(report: Report, plan: Plan, model: ModelSpec, cluster: Cluster) -> None:
    """Rich tables: headline numbers, time breakdown, memory per device group."""
    pipes = plan.pipelines
    strategies = sorted({s.short() for p in pipes for st in p.stages for s in st.strategies})
    micro = ", ".join(f"{p.micro_batches} x {p.micro_batch_sequences}" for p in pipes[:8]) \
        + (", ..." if len(pipes) > 8 else "")
    out.print(f"[bold]{model.name}[/] ({model.params / 1e9:.2f}B params) on [bold]{cluster.name}[/], "
              f"seq {plan.seq_len}, global batch {plan.global_batch}, {plan.precision}")
    tokens = f"; routed tokens: {plan.dispatcher}{', ep overlap' if plan.ep_overlap else ''}" \
        if model.has_experts else ""
    out.print(f"plan: {len(pipes)} pipeline(s), pp={plan.pp}, chunks={plan.chunks}, "
              f"schedule={plan.schedule}, micro-batches {micro} seqs; layers: {'; '.join(strategies)}{tokens}")
    _print_headline(report)
    bd = Table(title="time of the slowest device by cause", box=box.SIMPLE_HEAD)
    bd.add_column("cause")
    bd.add_column("time", justify="right")
    bd.add_column("share", justify="right")
    for key, value in report.breakdown.items():
        if value > 0:
            bd.add_row(key, fmt_s(value), f"{value / report.iteration_time_s:.1%}")
    out.print(bd)
    if len(report.by_kind) > 3:  # more than one layer kind besides the embedding and head
        _print_kinds(report)
    _print_memory(report, plan, cluster)


def _print_headline(report: Report) -> None:
    head = Table(title="prediction", show_header=False)
    head.add_column("metric")
    head.add_column("value", justify="right")
    host_over = report.host_memory_gib - report.host_capacity_gib
    fits = "[green]yes[/]" if report.fits else f"[red]no: {report.over_memory_gib:.1f} GiB over[/]" \
        if report.over_memory_gib > 0 else f"[red]no: host memory {host_over:.1f} GiB over[/]" if host_over > 0 \
        else f"[red]no: NVMe {report.nvme_gib - report.nvme_capacity_gib:.1f} GiB over[/]"
    for name, value in (
        ("iteration time", fmt_s(report.iteration_time_s)),
        ("throughput", f"{report.tokens_per_s:,.0f} tokens/s"),
        ("model TFLOP/s per GPU", f"{report.model_tflops_per_gpu:.1f} (MFU {report.mfu:.1%})"),
        ("hardware TFLOP/s per GPU", f"{report.hardware_tflops_per_gpu:.1f} (HFU {report.hfu:.1%})"),
        ("peak memory", f"{report.peak_memory_gib:.1f} of {report.memory_capacity_gib:.1f} GiB"),
        ("host memory per node", f"{report.host_memory_gib:.1f} of {report.host_capacity_gib:.0f} GiB"),
        *([("NVMe per node", f"{report.nvme_gib:.1f} of {report.nvme_capacity_gib:.0f} GiB")]
          if report.nvme_gib else []),
        ("fits", fits),
    ):
        head.add_row(name, value)
    out.print(head)


def _print_memory(report: Report, plan: Plan, cluster: Cluster) -> None:
    """Memory of each device group by term (the first 16 groups)."""
    from plait.cost.memory import unit

    name, size = unit(max(d.memory.total for d in report.devices))
    mem = Table(title=f"memory per device ({name})", box=box.SIMPLE_HEAD)
    multi = len(plan.pipelines) > 1
    nvme = any(d.nvme_bytes for d in report.devices)  # below the device: host memory, and NVMe where used
    for col in ("pipe",) * multi + ("stage", "ranks", "layers", "weights", "grads", "optim", "activ", "buf",
                                    "reserve", "total", "host") + ("nvme",) * nvme:
        mem.add_column(col, justify="right", no_wrap=True)
    for d in report.devices[:16]:
        t = d.memory
        total = f"{t.total / size:.1f}" if t.total <= cluster.gpu.memory_bytes else f"[red]{t.total / size:.1f}[/]"
        mem.add_row(*(str(d.pipeline),) * multi, str(d.index), ranks_text(d.ranks),
                    ",".join(f"{a}-{b - 1}" if b - a > 1 else str(a) for a, b in d.layers),
                    *(f"{v / size:.1f}" for v in (t.weights, t.gradients, t.optimizer, t.activations, t.buffers,
                                                  t.reserve)), total, f"{d.host_bytes / size:.1f}",
                    *(f"{d.nvme_bytes / size:.1f}",) * nvme)
    if len(report.devices) > 16:
        mem.caption = f"first 16 of {len(report.devices)} device groups"
    out.print(mem)


def _print_kinds(report: Report) -> None:
    """Time and memory of each layer kind (first pipeline)."""
    table = Table(title="by layer kind (first pipeline; seconds summed over its device groups)",
                  box=box.SIMPLE_HEAD)
    for col in ("kind", "layers", "params", "time", "share", "states GiB/dev", "activ GiB/mb/dev"):
        table.add_column(col, justify="left" if col == "kind" else "right")
    total = sum(k.seconds for k in report.by_kind.values()) or 1.0
    for kind, k in report.by_kind.items():
        table.add_row(kind, str(k.layers), f"{k.params / 1e9:.2f}B" if k.params >= 1e8 else f"{k.params / 1e6:.1f}M",
                      fmt_s(k.seconds), f"{k.seconds / total:.1%}", f"{k.states_gib:.2f}",
                      f"{k.activation_gib_per_micro_batch:.2f}")
    out.print(table)


def print_plan(plan: Plan, world: int | None = None) -> None:
    """The plan as a table: every stage with its layers grouped into runs of one strategy (and the ranks of
    a `world` that it leaves out)."""
    table = Table(title="plan: layers grouped by strategy", box=box.SIMPLE_HEAD)
    multi = len(plan.pipelines) > 1
    for col in ("pipe", "micro-batches") * multi + ("stage", "ranks", "layers", "strategy"):
        table.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=True)
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            layer = stage.layers[0]
            for ri, (strategy, count) in enumerate(stage.layer_strategies()):
                first = ri == 0
                lead = (str(pi), f"{pipe.micro_batches} x {pipe.micro_batch_sequences}") if first and si == 0 \
                    else ("", "")
                table.add_row(*lead * multi, str(si) if first else "", ranks_text(stage.ranks) if first else "",
                              f"{layer}-{layer + count - 1}" if count > 1 else str(layer), strategy.short())
                layer += count
    unused = sorted(set(range(world or plan.ranks[-1] + 1)) - set(plan.ranks))
    if unused:
        table.caption = f"ranks left out: {ranks_text(tuple(unused))}"
    out.print(table)
