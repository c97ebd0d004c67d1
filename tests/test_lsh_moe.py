"""LSH-MoE (`moe_comm=lsh`): cross-polytope buckets and centroids, the all-to-all bytes falling with the
measured compression rate on 2 gloo ranks, the experts' error on real text activations of tiny-moe, the
training loss against plain expert parallelism, and the cost model's terms."""

from __future__ import annotations

import tempfile
from importlib.resources import files
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from test_runtime import train_together

from plait.cost import experts
from plait.cost.calibration import calibration_for
from plait.cost.layer import BlockContext, block_time
from plait.cost.precision import PRECISIONS
from plait.models import build_model
from plait.models.moe import MoE
from plait.plan import Strategy, uniform_plan
from plait.runtime import experts as runtime_experts
from plait.runtime.lsh import LshCompressor, cluster, cross_polytope_codes, rotations
from plait.spec.cluster import dgx, local_ranks
from plait.spec.lsh import LSH_COMPRESSION_RATE
from plait.spec.model import PRESETS

MODEL = "tiny-moe"
GENESIS = Path(str(files("plait") / "data" / "kjv-genesis.txt"))


def test_cross_polytope_buckets_and_centroids() -> None:
    """A code is the argmax vertex of [Rx, -Rx] per hash, digits base 2d; centroids are bucket means per
    expert, and a token's gradient through its centroid is 1/|bucket| of the centroid's."""
    rot = rotations(16, 2, 3)
    assert torch.equal(rot, rotations(16, 2, 3)) and torch.allclose(rot[0].t() @ rot[0], torch.eye(3), atol=1e-6)
    x = torch.randn(50, 16)
    codes = cross_polytope_codes(x, rot)
    proj = [torch.cat([x @ r, -(x @ r)], 1).argmax(1) for r in rot]
    assert torch.equal(codes, proj[0] + 6 * proj[1])
    tokens = torch.cat([torch.ones(3, 16), torch.randn(4, 16)]).requires_grad_(True)
    counts = torch.tensor([3, 0, 4])
    c = cluster(tokens, counts, rot)
    assert c.counts[0] == 1 and c.counts[1] == 0 and c.rate == c.centroids.shape[0] / 7
    torch.testing.assert_close(c.centroids[0], torch.ones(16))
    for k in range(c.centroids.shape[0]):
        torch.testing.assert_close(c.centroids[k], tokens[c.member == k].mean(0))
    c.expand(c.centroids).sum().backward()
    torch.testing.assert_close(tokens.grad, torch.ones_like(tokens))  # each pair takes its centroid: sum of 1/n


TRAINED_STEPS = 60
"""Training steps before the activations are taken (enough for the routing to settle)."""


def _genesis_rows(start: int, sequences: int, seq: int) -> torch.Tensor:
    raw = torch.frombuffer(bytearray(GENESIS.read_bytes()), dtype=torch.uint8).long()
    return torch.stack([raw[start + i * seq * 3: start + i * seq * 3 + seq + 1] for i in range(sequences)])


def _moe_inputs(train_steps: int) -> tuple[torch.nn.Module, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """tiny-moe trained `train_steps` steps on Genesis, and the (block input, MoE input) of each MoE layer
    on 4 x 256 tokens of Genesis it did not train on."""
    torch.manual_seed(0)
    model = build_model(PRESETS[MODEL])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(train_steps):
        rows = _genesis_rows(step * 1024 % 40000, 8, 128)
        loss = F.cross_entropy(model(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, layer in model.layers.items():
        if any(isinstance(m, MoE) for m in layer.modules()):
            layer.ffn_norm.register_forward_hook(
                lambda mod, args, out, name=name: seen.__setitem__(name, (args[0].detach(), out.detach())))
    with torch.no_grad():
        model(_genesis_rows(60000, 4, 256)[:, :-1])
    return model, seen


def _errors(moe: MoE, h: torch.Tensor, x: torch.Tensor) -> dict[str, float]:
    """Compression rate and relative errors of the compressed MoE layer: of its output, of its block's output
    h + MoE(x), and of the output were x - c added to each pair's expert output as well."""
    with torch.no_grad():
        moe.compressor = None
        exact = moe(x)
        moe.compressor = LshCompressor()
        approx = moe(x)
        flat = x.reshape(-1, x.shape[-1])
        _, chosen, weights = moe.route(flat)
        order = chosen.flatten().argsort(stable=True)
        source = order // moe.top_k
        pairs = flat.index_select(0, source)
        c = moe.compressor.compress(pairs, torch.bincount(chosen.flatten(), minlength=moe.n_experts))
        residual = (pairs - c.expand(c.centroids)) * weights.flatten()[order].unsqueeze(-1)
        twice = approx + torch.zeros_like(flat).index_add(0, source, residual).view_as(x)
    rate = moe.compressor.rate
    moe.compressor = None
    err = float((approx - exact).norm())
    return {"rate": rate, "moe": err / float(exact.norm()), "block": err / float((h + exact).norm()),
            "residual added twice": float((twice - exact).norm()) / float(exact.norm())}


def test_error_on_real_text_activations() -> None:
    """tiny-moe trained TRAINED_STEPS steps on Genesis: at compression rates <= 0.25 every MoE layer's output is within
    0.2 (relative) of the uncompressed one, and so is its block's. Adding x - c to the expert output as well
    as keeping x on the skip path is no better, and on the untrained model far worse."""
    for steps in (TRAINED_STEPS, 0):
        model, seen = _moe_inputs(steps)
        for name, (h, x) in seen.items():
            moe = next(m for m in model.layers[name].modules() if isinstance(m, MoE))
            e = _errors(moe, h, x)
            print(f"trained {steps} layer {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in e.items()))
            assert e["rate"] <= 0.25
            if steps:
                assert e["moe"] <= 0.2 and e["block"] <= 0.2
                assert e["residual added twice"] >= e["moe"] - 0.01
            else:
                assert e["residual added twice"] > 10 * e["moe"]


def _count_bytes(rank: int, world: int, store_dir: str, inputs: torch.Tensor, out: dict) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(f"{store_dir}/store", world)
    dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
    sent = []
    plain = runtime_experts.all_to_all

    def counted(x, group, recv, send):  # noqa: ANN001, ANN202
        sent.append(x.numel() * x.element_size())
        return plain(x, group, recv, send)

    runtime_experts.all_to_all = counted
    torch.manual_seed(0)
    moe = MoE(PRESETS[MODEL].stack[1])
    moe.eval()
    mesh = dist.device_mesh.init_device_mesh("cpu", (1, world, 1), mesh_dim_names=("edp", "ep", "etp"))
    runtime_experts.shard_experts(moe, mesh)
    moe.exchange = runtime_experts.AllToAll(dist.group.WORLD)
    x = inputs[rank::world]
    result = {}
    for comm in ("alltoall", "lsh"):
        sent.clear()
        moe.compressor = LshCompressor() if comm == "lsh" else None
        moe(x)
        result[comm] = (sum(sent[::2]), moe.compressor.rate if moe.compressor else 1.0)  # dispatches (combines: odd)
    out[rank] = result
    dist.barrier()
    dist.destroy_process_group()


def test_all_to_all_bytes_scale_with_the_measured_compression_rate() -> None:
    """ep2 over 2 gloo ranks on real text activations: the dispatch sends the measured rate of the bytes."""
    _, seen = _moe_inputs(0)
    x = seen["1"][1]
    with tempfile.TemporaryDirectory() as tmp:
        out = mp.Manager().dict()
        mp.spawn(_count_bytes, args=(2, tmp, x, out), nprocs=2)
    for rank, r in out.items():
        ratio, rate = r["lsh"][0] / r["alltoall"][0], r["lsh"][1]
        print(f"rank {rank}: bytes {r['alltoall'][0]} -> {r['lsh'][0]}, ratio {ratio:.3f}, rate {rate:.3f}")
        assert ratio == pytest.approx(rate, rel=1e-9) and rate <= 0.25


def test_loss_after_200_steps_within_2_percent() -> None:
    """tiny-moe on Genesis, ep2 over 2 ranks, 200 steps: LSH-MoE ends within 2% of plain expert parallelism
    (mean of the last 20 steps' losses)."""
    with tempfile.TemporaryDirectory() as tmp:
        cases = {comm: (MODEL, f"dp=2,ep=2,moe_comm={comm},gbs=4") for comm in ("alltoall", "lsh")}
        runs = train_together(Path(tmp), GENESIS, 2, cases, {c: {"steps": 200} for c in cases})
    tail = {}
    for comm in cases:
        proc, losses = runs
        assert comm in losses and len(losses[comm]) == 200, proc.stderr[-3000:]
        tail[comm] = sum(losses[comm][-20:]) / 20
    gap = tail["lsh"] / tail["alltoall"] - 1
    print(f"loss: all-to-all {tail['alltoall']:.4f}, lsh {tail['lsh']:.4f}, gap {gap:+.4f}")
    assert abs(gap) <= 0.02
    assert runs[1]["lsh"][0] - tail["lsh"] > 0.5, "the runs must learn"


def test_cost_model_scales_the_exchange_and_adds_hashing() -> None:
    """moe_comm=lsh: the ep all-to-all time (beyond its fixed sync) and the experts' rows scale by the compression
    rate, and the hashing adds compute; plans carry the option through the --strategy shorthand."""
    model = PRESETS["mixtral-8x7b"]
    cluster = dgx(2, 8, "H100-80GB")
    block = model.stack[0]
    times = {}
    for s in (Strategy(dp=16, ep=8), Strategy(dp=16, ep=8, moe_comm="lsh")):
        ranks = tuple(range(s.devices))
        ctx = BlockContext.for_ranks(model, cluster, calibration_for(cluster.gpu.name), PRECISIONS["bf16"], 4096,
                                     1, s, ranks, s.degrees.group(ranks, "data"))
        times[s.moe_comm] = block_time(block, s, ctx)
    assert experts.lsh_time(block, Strategy(dp=16, ep=8), 4096, ctx) == (0.0, 0.0)
    assert experts.lsh_time(block, Strategy(dp=16, ep=8, moe_comm="lsh"), 4096, ctx)[0] > 0
    assert times["lsh"].ep_comm < times["alltoall"].ep_comm
    fixed = 4 * ctx.cal.moe_exchange_overhead_s  # the dispatchers' sync and wait: 2 exchanges a pass, 2 passes
    assert times["lsh"].ep_comm - fixed == pytest.approx((times["alltoall"].ep_comm - fixed) * LSH_COMPRESSION_RATE,
                                                        rel=0.2)
    plan = uniform_plan("dp=2,ep=2,moe_comm=lsh,gbs=4", PRESETS[MODEL], local_ranks(2), 64)
    assert plan.pipelines[0].stages[0].strategies[0].moe_comm == "lsh"
