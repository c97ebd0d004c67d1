"""What the runtime refuses (hand-written plans only: no planner emits these): one line naming the cause."""

from __future__ import annotations

from plait.executable import tied_copies, unsupported
from plait.plan import Pipeline, Plan, Stage, Strategy
from plait.spec.model import PRESETS

S = Strategy


def plan(model: str, stages: list[Stage], pipelines: int = 1, micro_batches: int = 4) -> Plan:
    pipe = Pipeline(stages=tuple(stages), micro_batches=micro_batches, micro_batch_sequences=2)
    return Plan(model=model, seq_len=64, global_batch=8 * pipelines, pipelines=(pipe,) * pipelines)


def test_per_layer_mixes_and_differently_laid_out_stages_run() -> None:
    p = plan("tiny-llama", [Stage(layers=(0, 2), ranks=(0, 1), strategies=(S(dp=2), S(tp=2, sp=True))),
                            Stage(layers=(2, 4), ranks=(2, 3), strategies=(S(cp=2, zero=3),))])
    assert unsupported(p, PRESETS["tiny-llama"]) is None


def test_tied_embeddings_run_under_any_layout_at_both_ends() -> None:
    """Ends laid out alike share the table (one stage) or sum it shard by shard (several); else the head
    keeps its own copy (`tied_copies`), also where per-layer ZeRO units would split one table in two."""
    gpt = PRESETS["tiny-gpt"]
    same = plan("tiny-gpt", [Stage(layers=(0, 2), ranks=(0, 1), strategies=(S(tp=2),)),
                             Stage(layers=(2, 4), ranks=(2, 3), strategies=(S(dp=2), S(tp=2, recompute="full")))])
    other = plan("tiny-gpt", [Stage(layers=(0, 2), ranks=(0, 1), strategies=(S(tp=2),)),
                              Stage(layers=(2, 4), ranks=(2, 3), strategies=(S(dp=2),))])
    one_stage = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(S(tp=2), S(dp=2), S(dp=2), S(dp=2)))])
    sharded_mix = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(
        S(dp=2, zero=3), S(tp=2), S(tp=2), S(dp=2, zero=3)))])
    plain_mix = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(
        S(dp=2), S(tp=2), S(tp=2), S(dp=2)))])
    uniform = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(S(dp=2, zero=3),))])
    for p in (same, other, one_stage, sharded_mix, plain_mix, uniform):
        assert unsupported(p, gpt) is None
    copies = {name: tied_copies(p) for name, p in (
        ("same", same), ("other", other), ("one_stage", one_stage), ("sharded_mix", sharded_mix),
        ("plain_mix", plain_mix), ("uniform", uniform))}
    assert copies == {"same": True, "other": True, "one_stage": True, "sharded_mix": True, "plain_mix": False,
                      "uniform": False}
    beside = Plan(model="tiny-gpt", seq_len=64, global_batch=8, pipelines=(
        one_stage.pipelines[0], uniform.pipelines[0].model_copy(update={"stages": (
            Stage(layers=(0, 4), ranks=(2, 3), strategies=(S(dp=2),)),)})))
    assert tied_copies(beside) and unsupported(beside, gpt) is None  # both pipelines hold two copies


def test_simulate_prices_the_heads_own_copy_of_a_tied_table() -> None:
    """A one-stage pipeline whose per-layer ZeRO-1 units hold the tied table twice: the head's copy adds
    vocab x hidden weights (ZeRO-1 leaves weights whole) to the one table of the same stage without ZeRO."""
    from plait.cost.precision import plan_precision
    from plait.simulate import simulate
    from plait.spec.cluster import local_ranks

    gpt = PRESETS["tiny-gpt"]

    def weights(strategies: tuple[Strategy, ...]) -> float:
        p = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=strategies)])
        return simulate(p, gpt, local_ranks(2), validate=False).devices[0].memory.weights

    one = weights((S(dp=2),) * 4)
    two = weights((S(dp=2, zero=1), S(dp=2), S(dp=2), S(dp=2, zero=1)))
    p = plan("tiny-gpt", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(S(dp=2),))])
    assert two - one == gpt.vocab * gpt.hidden * plan_precision(p.precision).param


def test_refusals_name_their_cause() -> None:
    llama = PRESETS["tiny-llama"]
    two = plan("tiny-llama", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(S(zero=1),))], pipelines=2)
    assert unsupported(two, llama) is None  # ZeRO across pipelines runs (states whole on each holder)
    ring = plan("tiny-llama", [Stage(layers=(0, 4), ranks=(0, 1), strategies=(S(cp=2, cp_mode="ring"),))])
    assert unsupported(ring, llama) is None  # ring context parallelism runs (plait.runtime.ring)
    widths = plan("tiny-llama", [Stage(layers=(0, 2), ranks=(0,), strategies=(S(),)),
                                 Stage(layers=(2, 4), ranks=(1, 2), strategies=(S(dp=2),))])
    assert unsupported(widths, llama) is None  # stages of different widths run (plait.runtime.pipeline_uneven)
    t5 = plan("tiny-t5", [Stage(layers=(0, 2), ranks=(0,), strategies=(S(),)),
                          Stage(layers=(2, 4), ranks=(1, 2), strategies=(S(dp=2),))])
    assert unsupported(t5, PRESETS["tiny-t5"]) is None  # the boundary carries T5's [B, T, 2H] state
    two_widths = plan("tiny-llama", [Stage(layers=(0, 2), ranks=(0,), strategies=(S(),)),
                                     Stage(layers=(2, 4), ranks=(1, 2), strategies=(S(tp=2),))], pipelines=2)
    assert unsupported(two_widths, llama) is None  # in each of several pipelines too
    few = plan("tiny-llama", [Stage(layers=(0, 2), ranks=(0,), strategies=(S(),)),
                              Stage(layers=(2, 4), ranks=(1,), strategies=(S(),))], micro_batches=1)
    assert unsupported(few, llama) is None  # fewer micro-batches than stages: the runtime's own schedule
    assert few.pipelines[0].own_schedule() and not ring.pipelines[0].own_schedule()


def test_hsdp_and_a_chosen_reduce_precision_run_also_in_moe_layers() -> None:
    llama, moe = PRESETS["tiny-llama"], PRESETS["tiny-moe"]
    hsdp = plan("tiny-llama", [Stage(layers=(0, 4), ranks=(0, 1, 2, 3), strategies=(S(dp=4, zero=3, shard=2),))])
    assert unsupported(hsdp, llama) is None
    for reduce in ("fp32", "bf16"):
        assert unsupported(hsdp.model_copy(update={"grad_reduce": reduce}), llama) is None
    moe_hsdp = plan("tiny-moe", [Stage(layers=(0, moe.layers), ranks=(0, 1, 2, 3),
                                       strategies=(S(dp=4, zero=3, shard=2),))])
    assert unsupported(moe_hsdp, moe) is None
    moe_fsdp = moe_hsdp.model_copy(update={"pipelines": (moe_hsdp.pipelines[0].model_copy(update={"stages": (
        Stage(layers=(0, moe.layers), ranks=(0, 1, 2, 3), strategies=(S(dp=4, zero=3),)),)}),)})
    assert unsupported(moe_fsdp, moe) is None




def test_megatron_p2p_is_priced_not_run() -> None:
    llama = PRESETS["tiny-llama"]
    p = plan("tiny-llama", [Stage(layers=(0, 1), ranks=(0, 1), strategies=(S(dp=2),)),
                            Stage(layers=(1, llama.layers), ranks=(2, 3), strategies=(S(dp=2),))])
    assert unsupported(p, llama) is None
    assert unsupported(p.model_copy(update={"p2p": "megatron"}), llama) == (
        "p2p=megatron prices Megatron-LM's synchronous pipeline exchanges, which the runtime does not run (its "
        "sends are asynchronous); set p2p to async")
