"""Pictures of a simulated step: pipeline timeline (Gantt) and per-device memory bars.

Uses matplotlib's object API (``matplotlib.figure.Figure`` rendered by Agg), so it never
touches pyplot state or needs a display. Files are written atomically.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict
from collections.abc import Mapping, Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from plait.cost.pipeline import PipelineResult

__all__ = ["combined", "plot_memory", "plot_timeline", "plot_waves", "save_figure_atomically"]

GIB = float(1 << 30)
_FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
_DPI = 120
_MAX_LABELS = 3000  # micro-batch numbers drawn at most (keeps huge timelines fast)
_MEMORY_COLORS = (
    "#4C72B0",
    "#DD8452",
    "#55A868",
    "#C44E52",
    "#8172B3",
    "#937860",
    "#DA8BC3",
    "#8C8C8C",
    "#CCB974",
    "#64B5CD",
)


def save_figure_atomically(fig: Figure, path: str | os.PathLike[str], dpi: int = _DPI) -> None:
    """Save ``fig`` to ``path`` via a temp file in the same directory and ``os.replace``.

    The format follows the extension (``.png``, ``.svg``, ``.pdf``); anything else is
    written as PNG. Missing parent directories are created. No partial file is ever
    visible at ``path`` and the temp file is removed on failure.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fmt = _FORMATS.get(os.path.splitext(path)[1].lower(), "png")
    if fig.canvas is None or not isinstance(fig.canvas, FigureCanvasAgg):
        FigureCanvasAgg(fig)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format=fmt, dpi=dpi)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# --------------------------------------------------------------------------- timeline


def _time_unit(span_s: float) -> tuple[float, str]:
    """Scale and label for the x axis: milliseconds for spans under a second."""
    return (1e3, "ms") if span_s < 1.0 else (1.0, "s")


def _shade(base: str, level: int, levels: int) -> tuple[float, float, float, float]:
    """``base`` colour lightened for later chunks (level 0 is the full colour)."""
    r, g, b, a = to_rgba(base)
    mix = 0.55 * level / max(levels - 1, 1)
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix, a)


def _draw_timeline(ax: Axes, result: PipelineResult, title: str) -> None:
    if not result.ops:
        raise ValueError("timeline needs the ops: simulate with record=True")
    p = result.devices
    chunks = max(op.chunk for op in result.ops) // p + 1
    scale, unit = _time_unit(result.makespan_s)
    colors = {"F": "#3A78C2", "B": "#E07B39"}

    bars: dict[tuple[str, int, int], list[tuple[float, float]]] = defaultdict(list)
    for op in result.ops:
        bars[(op.kind, op.chunk // p, op.device)].append(
            (op.start_s * scale, (op.end_s - op.start_s) * scale)
        )
    for (kind, level, device), spans in bars.items():
        ax.broken_barh(
            spans,
            (device - 0.4, 0.8),
            facecolors=_shade(colors[kind], level, chunks),
            edgecolors="white",
            linewidth=0.3,
        )

    # Micro-batch numbers where they fit: estimate the box width in points.
    span = result.makespan_s * scale or 1.0
    fig = ax.figure
    axes_width_pt = fig.get_figwidth() * 72.0 * ax.get_position().width
    fontsize = 7.0 if p <= 16 else 5.0
    labels = 0
    for op in result.ops:
        width_pt = (op.end_s - op.start_s) * scale / span * axes_width_pt
        text = str(op.micro_batch)
        if width_pt >= 0.62 * fontsize * len(text) + 2 and labels < _MAX_LABELS:
            ax.text(
                (op.start_s + op.end_s) / 2 * scale,
                op.device,
                text,
                ha="center",
                va="center",
                fontsize=fontsize,
                color="white" if op.chunk // p == 0 else "black",
                clip_on=True,
            )
            labels += 1

    ax.set_xlim(0.0, span)
    ax.set_ylim(p - 0.5, -0.5)  # device 0 at the top
    step = max(1, p // 16)
    ax.set_yticks(range(0, p, step), [f"dev {d}" for d in range(0, p, step)])
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    handles = [
        Patch(color=_shade(colors[k], c, chunks), label=f"{name}" + (f" chunk {c}" if chunks > 1 else ""))
        for k, name in (("F", "forward"), ("B", "backward"))
        for c in range(chunks)
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    bubble = sum(result.bubble_s) / (p * result.makespan_s) if result.makespan_s > 0 else 0.0
    ax.set_title(title or f"pipeline timeline: {result.makespan_s * scale:.3g} {unit}, bubble {bubble:.1%}")


def plot_timeline(result: PipelineResult, path: str | os.PathLike[str], title: str = "") -> None:
    """Gantt chart of a simulated step (one row per device, device 0 on top).

    Forward ops are blue, backward orange; later chunks of an interleaved schedule are
    lighter; the micro-batch number is written in each box that is wide enough. The x
    axis is in ms when the step is shorter than a second, else in s. ``result`` must come
    from ``simulate_pipeline(..., record=True)``.
    """
    fig = Figure(figsize=(12.0, 1.2 + 0.35 * max(result.devices, 2)), layout="constrained")
    _draw_timeline(fig.add_subplot(), result, title)
    save_figure_atomically(fig, path)


# --------------------------------------------------------------------------- memory


def _draw_memory(
    ax: Axes, devices: Sequence[tuple[str, Mapping[str, float]]], capacity_bytes: float, title: str
) -> None:
    keys: list[str] = []
    for _, terms in devices:
        keys += [k for k in terms if k not in keys]
    labels = [label for label, _ in devices]
    x = range(len(devices))
    bottom = [0.0] * len(devices)
    for i, key in enumerate(keys):
        heights = [terms.get(key, 0.0) / GIB for _, terms in devices]
        ax.bar(x, heights, bottom=bottom, width=0.7, label=key, color=_MEMORY_COLORS[i % len(_MEMORY_COLORS)])
        bottom = [b + h for b, h in zip(bottom, heights)]
    cap = capacity_bytes / GIB
    ax.axhline(cap, color="black", linestyle="--", linewidth=1.2, label=f"capacity {cap:.1f} GiB")
    for xi, total in zip(x, bottom):
        if total > cap:  # over capacity: mark the bar
            ax.bar(xi, total, width=0.7, fill=False, edgecolor="red", linewidth=1.5)
        if len(devices) <= 32:
            ax.annotate(
                f"{total:.1f}",
                (xi, total),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
            )
    ax.set_xticks(
        list(x),
        labels,
        rotation=45 if len(devices) > 8 else 0,
        ha="right" if len(devices) > 8 else "center",
        fontsize=8,
    )
    ax.set_ylabel("memory (GiB)")
    ax.set_ylim(0.0, max([cap, *bottom]) * 1.12 or 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or "memory per device")


def plot_memory(
    devices: Sequence[tuple[str, Mapping[str, float]]],
    capacity_bytes: float,
    path: str | os.PathLike[str],
    title: str = "",
) -> None:
    """Stacked bar per device (or stage) of memory terms, in GiB.

    ``devices`` is a sequence of ``(label, {term: bytes})``; terms are stacked in the order
    they first appear. A dashed line marks ``capacity_bytes``; bars above it get a red edge.
    """
    fig = Figure(figsize=(max(6.0, 1.0 + 0.45 * len(devices)) + 1.5, 4.5), layout="constrained")
    _draw_memory(fig.add_subplot(), devices, capacity_bytes, title)
    save_figure_atomically(fig, path)


def combined(
    result: PipelineResult,
    devices: Sequence[tuple[str, Mapping[str, float]]],
    capacity_bytes: float,
    path: str | os.PathLike[str],
    title: str = "",
) -> None:
    """Timeline (top) and memory bars (bottom) in one figure, saved atomically to ``path``."""
    p = result.devices
    fig = Figure(figsize=(12.0, 1.2 + 0.35 * max(p, 2) + 4.0), layout="constrained")
    grid = fig.add_gridspec(2, 1, height_ratios=[max(1.2, 0.35 * max(p, 2)), 4.0])
    _draw_timeline(fig.add_subplot(grid[0]), result, "")
    _draw_memory(fig.add_subplot(grid[1]), devices, capacity_bytes, "")
    if title:
        fig.suptitle(title)
    save_figure_atomically(fig, path)


# --------------------------------------------------------------------------- multi-task waves


def plot_waves(groups: Sequence[tuple[str, int, int, float, float]], devices: int, boundaries: Sequence[float],
               path: str | os.PathLike[str], title: str = "") -> None:
    """Waves of a multi-task plan: one row per device, one box per device group (label, first device,
    device count, start and length in seconds), coloured by the label's task (the text before "/"),
    with a dashed line where each wave ends (`boundaries`, seconds)."""
    fig = Figure(figsize=(12.0, 1.5 + 0.3 * max(devices, 2)), layout="constrained")
    ax = fig.add_subplot()
    span = max((start + length for *_, start, length in groups), default=1.0) or 1.0
    scale, unit = _time_unit(span)
    tasks = list(dict.fromkeys(label.split("/")[0] for label, *_ in groups))
    colors = {t: _MEMORY_COLORS[i % len(_MEMORY_COLORS)] for i, t in enumerate(tasks)}
    for label, first, count, start, length in groups:
        ax.broken_barh([(start * scale, length * scale)], (first - 0.45, count - 0.1),
                       facecolors=colors[label.split("/")[0]], edgecolors="white", linewidth=0.5)
        ax.text((start + length / 2) * scale, first + (count - 1) / 2, label.split("/")[-1], ha="center",
                va="center", fontsize=6, color="white", clip_on=True)
    for b in boundaries:
        ax.axvline(b * scale, color="black", linestyle="--", linewidth=0.6)
    ax.set_xlim(0.0, span * scale)
    ax.set_ylim(devices - 0.5, -0.5)
    step = max(1, devices // 16)
    ax.set_yticks(range(0, devices, step), [f"dev {d}" for d in range(0, devices, step)])
    ax.set_xlabel(f"time ({unit})")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=colors[t], label=t) for t in tasks], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=7)
    ax.set_title(title or f"waves: {span * scale:.3g} {unit}")
    save_figure_atomically(fig, path)
