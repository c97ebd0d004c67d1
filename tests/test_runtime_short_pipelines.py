"""Pipelines with fewer micro-batches than stages: torch.distributed.pipelining needs one per stage, so the
runtime runs them with its own GPipe / 1F1B schedule (`plait.runtime.pipeline_uneven`), whose op order the
cost model prices (`plait.cost.pipeline`)."""

from __future__ import annotations

import pytest
from test_runtime import text, train_together  # noqa: F401

from plait.cost.pipeline import schedule_order
from plait.runtime.pipeline_uneven import order

SHORT = {
    "pp2 dp2 m1 gpipe, tied": ("tiny-gpt", "pp=2,dp=2,mbs=2,gbs=4,schedule=gpipe"),
    "pp4 m2": ("tiny-llama", "pp=4,mbs=2,gbs=4"),
}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", [(4, 1), (4, 2), (3, 2), (2, 1)])
def test_cost_model_prices_the_order_the_runtime_runs(schedule: str, p: int, m: int) -> None:
    """Each device's forwards and backwards in the cost model's order are the runtime schedule's."""
    priced = schedule_order(schedule, p, m)
    for d in range(p):
        ran = [(what, k) for what, k in order(schedule, p, d, m)]
        assert [(op[0], op[1]) for op in priced[d]] == ran, (d, priced[d])


STEPS = 3


def test_short_pipelines_match_single_process(tmp_path_factory, text) -> None:  # noqa: F811
    models = ("tiny-llama", "tiny-gpt")
    _, ref = train_together(tmp_path_factory.mktemp("one"), text, 1, {m: (m, "dp=1,gbs=4") for m in models},
                            {m: {"steps": STEPS} for m in models})
    proc, got = train_together(tmp_path_factory.mktemp("short"), text, 4, SHORT,
                               {k: {"steps": STEPS} for k in SHORT})
    for key, (model, _) in SHORT.items():
        assert len(ref[model]) == STEPS and len(got.get(key, [])) == STEPS, proc.stderr[-3000:]
        assert got[key] == pytest.approx(ref[model], abs=1e-5), key
