"""Pipelines with fewer micro-batches than stages: torch.distributed.pipelining needs one per stage, so the
runtime runs them with its own GPipe / 1F1B schedule (`plait.runtime.pipeline_uneven`), whose op order the
cost model prices (`plait.cost.pipeline`)."""

from __future__ import annotations

import pytest
from test_runtime import _losses, assert_same, reference_losses, text, train_together  # noqa: F401

from plait.cost.pipeline import schedule_order
from plait.runtime.pipeline_uneven import order

SHORT = {
    "pp2 dp2 m1 gpipe, tied": ("tiny-gpt", "pp=2,dp=2,mbs=2,gbs=4,schedule=gpipe"),
    "pp2 tp2 sp m1": ("tiny-llama", "pp=2,tp=2,sp=1,mbs=4,gbs=4"),
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


def test_short_pipelines_match_single_process(tmp_path_factory, text) -> None:  # noqa: F811
    ref = reference_losses(tmp_path_factory.mktemp("reference"), text, [("tiny-llama", 4), ("tiny-gpt", 4)])
    runs = train_together(tmp_path_factory.mktemp("short"), text, 4, SHORT)
    for key, (model, _) in SHORT.items():
        assert_same(_losses(runs, key), ref[(model, 4)])
