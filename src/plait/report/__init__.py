"""The HTML report: one self-contained page (inline CSS, JS and SVG; no network) that renders one embedded
JSON object: the `--json` result of a command, and for every alternative plan its plan, its report and its
simulated pipeline timeline.

`page_data` builds that object, `render` fills the page template (page.html) with it, and `Alternatives`
collects the plans a search prices and keeps the Pareto set of iteration time against peak memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

from plait.cost.calibration import Calibration
from plait.cost.pipeline import PipelineResult
from plait.errors import PlaitError
from plait.io import json_line, write_atomically
from plait.plan import Plan
from plait.planner.baselines import Candidate
from plait.simulate import Report, finish, price_plan, simulate
from plait.spec.cluster import GIB, Cluster
from plait.spec.model import ModelSpec

MAX_ALTERNATIVES = 24
"""Pareto plans a page offers at most (spread evenly along the front, its ends kept)."""
MAX_PRICED_POINTS = 4000
"""Priced plans drawn behind the Pareto front at most."""
MAX_PIPELINES = 8
"""Pipelines whose timelines a page holds at most (per alternative)."""
MAX_OPS = 20000
"""Ops per pipeline timeline a page holds at most (the first ones in time)."""
DATA_MARK = "__PLAIT_REPORT_DATA__"


@dataclass(frozen=True)
class Alternative:
    """A plan the reader can pick: its label, the plan and its simulated report (with recorded ops)."""

    label: str
    plan: Plan
    report: Report
    report_dict: dict | None = None  # the numbers to show when they come from a saved `--json` report


def timeline(result: PipelineResult) -> dict:
    """A pipeline's recorded ops as compact rows [device, kind, micro-batch, chunk, start_s, end_s]."""
    ops = result.ops[:MAX_OPS]
    return {"devices": result.devices, "makespan_s": result.makespan_s, "truncated": len(result.ops) > len(ops),
            "ops": [[o.device, o.kind, o.micro_batch, o.chunk, o.start_s, o.end_s] for o in ops]}


def plan_rows(plan: Plan) -> list[dict]:
    """Every stage of `plan` with its layers grouped into runs of one strategy: [first, last, strategy]."""
    rows = []
    for pi, pipe in enumerate(plan.pipelines):
        for si, stage in enumerate(pipe.stages):
            layer, runs = stage.layers[0], []
            for strategy, count in stage.layer_strategies():
                runs.append([layer, layer + count - 1, strategy.short()])
                layer += count
            rows.append({"pipeline": pi, "stage": si, "ranks": list(stage.ranks),
                         "micro_batches": pipe.micro_batches, "micro_batch_sequences": pipe.micro_batch_sequences,
                         "runs": runs})
    return rows


def layout_text(plan: Plan) -> str:
    """A short description of a plan's layout: pipeline degree, chunks, micro-batches and strategies."""
    pipe = plan.pipelines[0]
    layouts = sorted({s.short() for st in pipe.stages for s in st.strategies})
    chunks = f" x{plan.chunks}" if plan.chunks > 1 else ""
    kinds = "; ".join(layouts) if len(layouts) <= 2 else f"{len(layouts)} per-layer strategies"
    return f"pp{plan.pp}{chunks} m{pipe.micro_batches} {kinds}"


def alternative_data(alt: Alternative) -> dict:
    """One alternative as the page reads it."""
    plan = alt.plan
    return {"label": alt.label, "layout": layout_text(plan), "schedule": plan.schedule, "chunks": plan.chunks,
            "plan": json.loads(plan.model_dump_json()), "stages": plan_rows(plan),
            "report": alt.report_dict if alt.report_dict is not None else alt.report.to_dict(),
            "timelines": [timeline(r) for r in alt.report.pipelines[:MAX_PIPELINES]],
            "pipelines": len(alt.report.pipelines)}


def page_data(command: str, result: dict, alternatives: Sequence[Alternative], model: ModelSpec,
              cluster: Cluster, priced: Sequence[tuple[float, float]] = (), settings: dict | None = None) -> dict:
    """The object a page renders: `result` (the command's `--json` object, unchanged), the alternatives
    (the first is the plan `result` reports), the (seconds, GiB) of every plan a search priced, and the
    command's settings (by default the first plan's sequence length, global batch and precision)."""
    if settings is None:
        plan = alternatives[0].plan
        settings = {"seq": plan.seq_len, "global batch": plan.global_batch, "precision": plan.precision}
    return {
        "command": command,
        "result": result,
        "model": {"name": model.name, "params": model.params, "layers": model.layers},
        "cluster": {"name": cluster.name, "world_size": cluster.world_size, "gpu": cluster.gpu.name,
                    "memory_gib": cluster.gpu.memory_bytes / GIB, "speed": list(cluster.speed)},
        "settings": settings,
        "alternatives": [alternative_data(a) for a in alternatives],
        "priced": [list(p) for p in _spread(list(priced), MAX_PRICED_POINTS)],
    }


def render(data: dict) -> str:
    """The HTML page with `data` embedded as JSON (`<`, `>` and `&` escaped, so no text ends the script)."""
    text = json_line(data).strip().replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    template = (files("plait.report") / "page.html").read_text(encoding="utf-8")
    return template.replace(DATA_MARK, text, 1)


def write_page(path: Path, command: str, result: dict, alternatives: Sequence[Alternative], model: ModelSpec,
               cluster: Cluster, settings: dict | None = None) -> None:
    """Write the page of `page_data(...)` to `path` atomically (PlaitError names `path`)."""
    write_atomically(path, render(page_data(command, result, alternatives, model, cluster, settings=settings)))


def recorded(label: str, candidate: Candidate, model: ModelSpec, cluster: Cluster, cal: Calibration | None
             ) -> Alternative:
    """A simulated candidate with its ops recorded (its numbers stay the candidate's report's)."""
    report = simulate(candidate.plan, model, cluster, cal, record=True, validate=False)
    return Alternative(label, candidate.plan, report, candidate.report.to_dict())


def plan_page(result: dict, chosen: Candidate, baselines: dict[str, Candidate | None],
              collected: Alternatives | None, model: ModelSpec, cluster: Cluster, cal: Calibration | None) -> str:
    """The page of a `plait plan` run: the chosen plan, the baselines it ran, and the search's Pareto plans."""
    alternatives = [recorded("chosen", chosen, model, cluster, cal)]
    alternatives += [recorded(kind, b, model, cluster, cal) for kind, b in baselines.items() if b is not None]
    if collected is not None:
        alternatives += collected.front(model, cluster, cal, {_identity(a.plan) for a in alternatives})
    priced = collected.points if collected is not None else []
    return render(page_data("plan", result, alternatives, model, cluster, priced))


def read_saved(path: Path) -> dict:
    """A saved `plait simulate --json` or `plait plan --json` report (PlaitError when it is neither)."""
    try:
        saved = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlaitError(f"--from {str(path)!r}: cannot read a JSON report ({exc}); give the output of "
                         "`plait simulate --json` or `plait plan --json`") from None
    if not isinstance(saved, dict) or not ("iteration_time_s" in saved or isinstance(saved.get("report"), dict)):
        raise PlaitError(f"--from {str(path)!r} is not a `plait simulate --json` or `plait plan --json` report")
    return saved


def embedded_data(html: str) -> dict:
    """The JSON object a rendered page embeds (the inverse of `render`)."""
    start = html.index('<script id="plait-data" type="application/json">')
    start = html.index(">", start) + 1
    return json.loads(html[start:html.index("</script>", start)])


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points (seconds, GiB) no other point beats in both, fastest first (ties: first kept)."""
    front: list[int] = []
    best_memory = float("inf")
    for i in sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1], i)):
        if points[i][1] < best_memory:
            front.append(i)
            best_memory = points[i][1]
    return front


def _identity(plan: Plan) -> str:
    """What makes two plans the same layout (their metadata aside)."""
    return plan.model_dump_json(exclude={"model", "model_fingerprint"})


def _spread(items: list, limit: int) -> list:
    """At most `limit` of `items`, evenly spaced, the first and last kept."""
    if len(items) <= limit:
        return items
    step = (len(items) - 1) / (limit - 1)
    return [items[round(k * step)] for k in range(limit)]


@dataclass
class Alternatives:
    """Collects the plans a search prices (`record` is the search's callback), then prices them once more
    (`front`) for the Pareto set of iteration time against peak memory."""

    plans: dict[str, Plan] = field(default_factory=dict)
    points: list[tuple[float, float]] = field(default_factory=list)

    @property
    def record(self) -> Callable[[Plan], None]:
        """The callback that sees every plan the search prices."""
        return lambda plan: self.plans.setdefault(plan.model_dump_json(), plan) and None

    def front(self, model: ModelSpec, cluster: Cluster, cal: Calibration | None, exclude: Collection[str] = ()
              ) -> list[Alternative]:
        """The Pareto plans (at most MAX_ALTERNATIVES, none of the layouts in `exclude`) simulated on
        `cluster` with their ops recorded; `points` then holds (seconds, GiB) of every plan collected."""
        plans = list(self.plans.values())
        reports = [finish(price_plan(p, model, cluster, cal, validate=False), detail=False) for p in plans]
        self.points = [(r.iteration_time_s, r.peak_memory_gib) for r in reports]
        front = [i for i in pareto_front(self.points) if _identity(plans[i]) not in exclude]
        chosen = _spread(front, MAX_ALTERNATIVES)
        return [Alternative(f"pareto {k + 1}", plans[i], simulate(plans[i], model, cluster, cal, record=True,
                                                                   validate=False))
                for k, i in enumerate(chosen)]


__all__ = ["Alternative", "Alternatives", "embedded_data", "page_data", "pareto_front", "render"]
