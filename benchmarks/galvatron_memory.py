"""plait's memory model against Galvatron 2.4.0's, on Galvatron's own measured memory profile.

    python benchmarks/galvatron_memory.py [--cpu] [--markdown]

Llama-2-7B on 8 A100-80GB, global batch 64, sequences of 2048 and 4096 tokens, a few plans. For each plan
it prints the peak bytes per device by term of three models: plait's default (formulas), plait calibrated
with Galvatron's profile (`--galvatron-profile`, cost/measured_memory.py), and Galvatron's own cost model
re-implemented below on the same profile. A second table compares one block's saved activations per
sequence with the measured profile and with Korthikanti et al. 2022's formula; `--cpu` adds the bytes
plait's profiler measures for its own runtime's blocks on this machine's CPU (tiny shapes, fp32).

The profile is the one Galvatron 2.4.0 ships for llama-7b (models/llama_fa/configs, identical non-sp
entries to llama_hf; a copy is tests/data/galvatron/llama_fa), measured on A100s with Galvatron's runtime.
MiB (2^20 bytes) throughout, as Galvatron's "MB".
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from plait.cost.calibration import calibration_for
from plait.cost.comm import SINGLE
from plait.cost.layer import BlockContext, block_activation_bytes
from plait.cost.precision import PRECISIONS
from plait.galvatron import load_galvatron_profiles, to_calibration
from plait.plan import Strategy, uniform_plan
from plait.simulate import simulate
from plait.spec.cluster import dgx
from plait.spec.model import PRESETS, load_model

MIB = 2**20
DATA = Path(__file__).resolve().parent.parent / "tests" / "data" / "galvatron"
PROFILE_DIR = DATA / "llama_fa"
HARDWARE_DIR = DATA / "hardware_configs"
PROFILED_SEQ = 2048
"""Sequence length the shipped profile was measured at (its file name's seqlen2048)."""
GLOBAL_BATCH = 64
PYTORCH_CONTEXT_MIB = 1024
"""Galvatron's TrainArgs.pytorch_context_mem default (core/search_engine/cost_model_args.py): a constant,
not a measurement."""

# (label, plait --strategy, Galvatron (pp, tp, dp, fsdp, zero2), Galvatron's name for its nearest plan)
PLANS = [
    ("ZeRO-3 dp8, 4 x 16", "tp=1,pp=1,dp=8,zero=3,mbs=2,gbs=64", (1, 1, 8, True, False), "fsdp"),
    ("ZeRO-1 tp2 dp4, 4 x 16", "tp=2,pp=1,dp=4,zero=1,mbs=4,gbs=64", (1, 2, 4, False, False), "ddp (no ZeRO-1)"),
    ("ZeRO-2 tp2 dp4, 4 x 16", "tp=2,pp=1,dp=4,zero=2,mbs=4,gbs=64", (1, 2, 4, False, True), "zero2"),
    ("pp2 dp4 ZeRO-2 1F1B, 8 x 8", "tp=1,pp=2,dp=4,zero=2,mbs=2,gbs=64", (2, 1, 4, False, True), "zero2"),
]


@dataclass(frozen=True)
class GalvatronTerms:
    """Galvatron's predicted MiB on the device of its first pipeline stage, by term."""

    states: float  # the blocks' model states
    unsharded: float  # the part of `states` its ZeRO ratios keep unsharded (the +1/8 or +2/8 term)
    activations: float  # the blocks' saved activations
    edge_states: float  # embedding and head ("other" memory)
    edge_activations: float
    context: float

    @property
    def total(self) -> float:
        return self.states + self.activations + self.edge_states + self.edge_activations + self.context


def _chunk_like_torch(n: int, chunks: int) -> list[int]:
    """Sizes of torch.chunk(range(n), chunks) (Galvatron's chunk_like_torch)."""
    size = math.ceil(n / chunks)
    return [min(size, n - i) for i in range(0, n, size)]


def galvatron_memory(mem: dict, layers: int, pp: int, tp: int, dp: int, fsdp: bool, zero2: bool, chunks: int,
                     seq: int) -> GalvatronTerms:
    """Galvatron 2.4.0's MemoryCostModel (core/search_engine/cost_model.py: initialize,
    estimate_model_states_size, estimate_activation_size, estimate_other_memory_cost) for one uniform plan
    on its first stage, bf16 (mixed_precision), async_grad_reduce on (its default), 1F1B
    (pipedream_flush), no vtp/vsp/embed_sdp, min_tp = tp. Lengths other than the profiled one scale as
    its "sequence" memory mode does (core/search_engine/search_engine.py, get_profiled_model_configs):
    block activations linearly, the one-stage edges' activation 2/3 fixed + 1/3 linear, the first stage's
    not, the last stage's linearly."""
    layer, scale = mem["layertype_0"], seq / PROFILED_SEQ
    n = GLOBAL_BATCH // dp  # global_batch_size / dp / (tp // min_tp)
    micro = _chunk_like_torch(n, chunks)
    end = min(pp, chunks)  # pp_size - stage_idx, capped at chunks
    bsz = sum(micro[:end]) / sum(micro) * GLOBAL_BATCH / dp
    d = dp  # sdp_size without Ulysses
    # chunks > 1 with async_grad_reduce, mixed precision: the fixed part is what stays unsharded
    zero3_fixed, zero2_fixed = 1 / 8, 2 / 8
    zero3_ratio = (1 - zero3_fixed) * (1 / d + 0.003) + zero3_fixed
    zero2_ratio = (1 - zero2_fixed) * (1 / d + 0.003) + zero2_fixed
    full = 4 * layer["parameter_size"] / tp
    ratio, fixed = (zero3_ratio, zero3_fixed) if fsdp else (zero2_ratio, zero2_fixed) if zero2 else (1.0, 0.0)
    act = layer["tp_activation_per_bsz_dict"][str(tp)] * scale * bsz
    per_stage = layers // pp
    other_bsz = GLOBAL_BATCH / dp / chunks
    ms_ratio = zero2_ratio if zero2 else 1.0  # use_zero2_for_dp; embed_sdp off
    if pp == 1:
        o = mem["other_memory_pp_off"]
        edge_act = o["activation"] * (2 / 3 + scale / 3) / tp * other_bsz
    else:
        o = mem["other_memory_pp_on_first"]
        edge_act = o["activation"] / tp * other_bsz * pp
    return GalvatronTerms(per_stage * full * ratio, per_stage * full * fixed, per_stage * act,
                          o["model_states"] / tp * ms_ratio, edge_act, PYTORCH_CONTEXT_MIB)


def deferred_gradients(text: str) -> float:
    """MiB of gradients that plait's runtime keeps unsharded beyond what its model counts, on the first
    stage's device: under ZeRO-2/3 with several micro-batches it turns the data-parallel reduction off until
    the last one (runtime/train.py, set_gradient_sync), and FSDP2 then accumulates each parameter's whole
    gradient (FSDPParam.unsharded_accumulated_grad) at the gradient precision (4 bytes)."""
    d = dict(kv.split("=") for kv in text.split(","))
    tp, pp, dp, zero, mbs = (int(d[k]) for k in ("tp", "pp", "dp", "zero", "mbs"))
    if zero < 2 or GLOBAL_BATCH // dp // mbs <= 1:
        return 0.0
    model = PRESETS["llama2-7b"]
    params = (model.layers // pp * model.block.params + model.embedding_params) / tp
    return params * PRECISIONS["bf16"].grad * (1 - 1 / dp) / MIB


def _plait(text: str, seq: int, cal) -> dict[str, float]:
    """plait's memory of the largest device by term, MiB."""
    model, cluster = PRESETS["llama2-7b"], dgx(1, 8, "A100-80GB")
    plan = uniform_plan(text, model, cluster, seq)
    report = simulate(plan, model, cluster, cal)
    m = max((d.memory for d in report.devices), key=lambda m: m.total)
    return {"states": (m.weights + m.gradients + m.optimizer) / MIB, "act": m.activations / MIB,
            "buffers": m.buffers / MIB, "reserve": m.reserve / MIB, "total": m.total / MIB}


def _calibrated(seq: int):
    model, cluster = PRESETS["llama2-7b"], dgx(1, 8, "A100-80GB")
    galv = load_galvatron_profiles(PROFILE_DIR, HARDWARE_DIR, "A100-80GB", seq_len=seq)
    return to_calibration(galv, model, cluster, calibration_for(cluster.gpu.name))


def plan_rows() -> list[list[str]]:
    import json

    mem = json.loads((PROFILE_DIR / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json").read_text())
    rows = []
    for seq in (2048, 4096):
        cal = _calibrated(seq)
        for label, text, (pp, tp, dp, fsdp, zero2), name in PLANS:
            chunks = GLOBAL_BATCH // dp // int(dict(kv.split("=") for kv in text.split(","))["mbs"])
            default, calibrated = _plait(text, seq, None), _plait(text, seq, cal)
            g = galvatron_memory(mem, 32, pp, tp, dp, fsdp, zero2, chunks, seq)
            deferred = deferred_gradients(text)
            rows.append([label, str(seq),
                         f"{default['act']:,.0f}", f"{calibrated['act']:,.0f}",
                         f"{g.activations + g.edge_activations:,.0f}",
                         f"{default['states']:,.0f}", f"{calibrated['states']:,.0f}",
                         f"{g.states + g.edge_states:,.0f}", f"{g.unsharded:,.0f}", f"{deferred:,.0f}",
                         f"{default['buffers'] + default['reserve']:,.0f}", f"{g.context:,.0f}",
                         f"{default['total'] / 1024:.1f}", f"{calibrated['total'] / 1024:.1f}",
                         f"{(calibrated['total'] + deferred) / 1024:.1f}", f"{g.total / 1024:.1f} ({name})"])
    return rows


def per_layer_rows(cpu: bool) -> list[list[str]]:
    """One block's saved activations per sequence at tp 1, MiB: plait's formula with three and with four
    SwiGLU tensors, Galvatron's measurement, Korthikanti's formula (eager and flash)."""
    import json

    rows = []
    cases = [("llama2-7b", PROFILE_DIR / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json"),
             ("gpt:layers=32,hidden=4096,heads=32,vocab=50257",
              DATA / "gpt_hf" / "memory_profiling_bf16_hidden4096_head32_seqlen2048.json")]
    for ref, path in cases:
        model = PRESETS.get(ref) or load_model(ref)
        block, s, h, a = model.block, PROFILED_SEQ, model.hidden, model.heads
        ctx = BlockContext(model, dgx(1, 8, "A100-80GB"), calibration_for("A100-80GB"), PRECISIONS["bf16"], s, 1,
                           SINGLE, SINGLE, SINGLE)
        plait_now = block_activation_bytes(block, Strategy(), ctx) / MIB
        gated = 2 * block.ffn * s / MIB if block.gated_mlp else 0.0  # the SwiGLU tensor the old count missed
        measured = json.loads(path.read_text())["layertype_0"]["tp_activation_per_bsz_dict"]["1"]
        korthikanti_eager = s * h * (34 + 5 * a * s / h) / MIB
        korthikanti_flash = s * h * 34 / MIB
        rows.append([model.name, f"{plait_now - gated:.1f}", f"{plait_now:.1f}", f"{measured:.1f}",
                     f"{korthikanti_flash:.1f}", f"{korthikanti_eager:.1f}",
                     f"{(plait_now / measured - 1) * 100:+.1f}%"])
    if cpu:
        rows += cpu_rows()
    return rows


def cpu_rows() -> list[list[str]]:
    """plait's profiler on this CPU (fp32, tiny shapes, 2 x 256 tokens): bytes per token per hidden unit at
    16-bit of its own runtime's blocks, against the formula."""
    from plait.profile.layers import measure_layers

    rows = []
    for ref in ("llama:layers=2,hidden=256,heads=4,kv_heads=4,ffn=688,vocab=1000",
                "gpt:layers=2,hidden=256,heads=4,vocab=1000,dropout=0"):
        model = load_model(ref)
        layers, _ = measure_layers(model, tps=(1,), points=((2, 256),), recompute=("none",), quick=True)
        ctx = BlockContext(model, dgx(1, 8, "A100-80GB"), calibration_for("A100-80GB"), PRECISIONS["fp32"], 256, 2,
                           SINGLE, SINGLE, SINGLE)
        formula = block_activation_bytes(model.block, Strategy(), ctx) / (2 * 256)
        measured = layers[0].activation_bytes_per_token
        rows.append([f"CPU {ref.split(':')[0]} h=256 (bytes/token/h, fp32)", "", f"{formula / 256:.2f}",
                     f"{measured / 256:.2f}", "", "", f"{(formula / measured - 1) * 100:+.1f}%"])
    return rows


PLAN_COLUMNS = ("plan", "seq", "act plait", "act calibrated", "act Galvatron", "states plait", "states calibrated",
                "states Galvatron", "of which unsharded (Galvatron)", "deferred-sync grads (plait runtime)",
                "buffers+reserve plait", "context Galvatron", "total plait", "total calibrated",
                "calibrated + deferred grads", "total Galvatron")
LAYER_COLUMNS = ("model", "plait, 3 SwiGLU tensors", "plait now", "Galvatron measured", "Korthikanti flash 34sbh",
                 "Korthikanti eager", "plait vs measured")


def _markdown(columns: tuple[str, ...], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    plans, layers = plan_rows(), per_layer_rows("--cpu" in sys.argv)
    if "--markdown" in sys.argv:
        print(_markdown(PLAN_COLUMNS, plans) + "\n\n" + _markdown(LAYER_COLUMNS, layers))
        return
    console = Console(width=240)
    for title, columns, rows in (
            ("Peak memory of the first stage's device, Llama-2-7B, 8 x A100, global batch 64 (MiB; totals GiB)",
             PLAN_COLUMNS, plans),
            ("One block's saved activations per 2048-token sequence at tp 1 (MiB)", LAYER_COLUMNS, layers)):
        t = Table(title=title)
        for c in columns:
            t.add_column(c, justify="right")
        for row in rows:
            t.add_row(*row)
        console.print(t)


if __name__ == "__main__":
    main()
