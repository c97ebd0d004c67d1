"""The cost model against published training runs (no row is special-cased in the model)."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import load_benchmark

from plait.published import load_runs, relative_errors
from plait.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
# The copy in the checkout, so that the result never depends on what sits beside it.
REFERENCE = ROOT / "tests" / "data" / "reference-training-runs.json"
COLLECTED = ROOT / "benchmarks" / "data" / "published_runs.json"

reference_runs, reference_skipped = load_runs(REFERENCE)


def test_every_reference_run_is_simulated() -> None:
    assert not reference_skipped
    assert len(reference_runs) == 6


@pytest.mark.parametrize("run", reference_runs, ids=lambda r: f"{r.model.name}-{r.cluster.world_size}gpu-"
                         f"{r.plan.pipelines[0].stages[0].strategies[0].recompute}")
def test_reference_runs_within_10_percent(run) -> None:
    report = run.report()
    for key, (published, predicted, error) in relative_errors(run, report).items():
        assert abs(error) <= 0.10, f"{key}: published {published}, predicted {predicted:.4g} ({error:+.1%})"


def test_collected_megatron_runs_generalise() -> None:
    """Runs of Megatron-LM whose layout is fully published: median error 4.3%, max 8.5% (before Megatron-LM's
    synchronous pipeline exchanges were priced: 5.4%, 10.6%)."""
    runs, _ = load_runs(COLLECTED)
    errors = []
    for run in runs:
        if not run.fully_published or run.group != "megatron":
            continue
        report = run.report()
        errors.extend(abs(e) for _, _, e in relative_errors(run, report).values())
    assert len(errors) >= 10
    assert statistics.median(errors) <= 0.045
    assert max(errors) <= 0.09


def test_all_collected_megatron_runs_mostly_within_10_percent() -> None:
    runs, skipped = load_runs(COLLECTED)
    assert all("fp8" in reason for _, reason in skipped)
    errors = [abs(e) for run in runs if run.group == "megatron"
              for _, _, e in relative_errors(run, run.report()).values()]
    assert len(errors) >= 60
    assert sum(e <= 0.10 for e in errors) >= 0.9 * len(errors)


def test_every_collected_megatron_figure_keeps_its_accuracy() -> None:
    """All 84 Megatron-LM figures, layout fully published or not: median 3.5%, max 10.4% (MegaScale's 530B bars
    on 11,200 A100); before: 4.2%, 16.5%. Two changes: Megatron-LM's synchronous pipeline exchanges are priced
    (MegaScale's 530B rows from +14.4..+16.5% to +8.4..+10.4%), and the Llama 3 405B rows hold one layer fewer on
    their first and last pipeline stage, as published (16K H100 from -12.8% to -7.5% MFU, 8K from -0.6% to
    +6.0%)."""
    runs, _ = load_runs(COLLECTED)
    errors = [abs(e) for run in runs if run.group == "megatron"
              for _, _, e in relative_errors(run, run.report()).values()]
    assert len(errors) == 84
    assert statistics.median(errors) <= 0.036
    assert max(errors) <= 0.105


def _fsdp_predictions() -> list[tuple[object, float, float]]:
    """(run, published tokens/s, predicted tokens/s) of every collected FSDP / ZeRO-2/3 row."""
    runs, _ = load_runs(COLLECTED)
    out = []
    for run in runs:
        if run.group == "fsdp":
            published, predicted, _ = relative_errors(run, run.report())["tokens_per_s"]
            out.append((run, published, predicted))
    return out


FSDP = _fsdp_predictions()


def _errors(held_out: bool | None = None) -> list[float]:
    return [abs(pred / pub - 1) for run, pub, pred in FSDP if held_out is None or run.held_out == held_out]


def test_fsdp_rows_are_collected_with_a_held_out_third() -> None:
    assert len(FSDP) == 125
    assert sum(run.held_out for run, _, _ in FSDP) == 41
    assert {run.cluster.gpu.name for run, _, _ in FSDP} == {"A100-40GB", "A100-80GB", "H100-80GB"}


def test_fsdp_rows_the_constants_were_chosen_on() -> None:
    """benchmarks/published_runs.py: median 4.8%, max 17.7% (before llm-foundry's rows were priced with their
    Triton attention: 5.7%, 21.6%; before the FSDP terms: 24.2%, 70.4%)."""
    errors = _errors(held_out=False)
    assert statistics.median(errors) <= 0.05
    assert max(errors) <= 0.18


def test_fsdp_held_out_rows() -> None:
    """Median 5.2% (7.6% before the Triton attention, 26.5% before the FSDP terms). The rows beyond 20% are
    MPT-30b at sequence 8192 with micro-batch 1 on 8 A100-80GB and 8 H100 (+25%, +29%), and a 70B run on 64
    A100-40GB at micro-batch 2 (+30%), published ~27% below the same model on 128 GPUs at micro-batch 4. They
    lack 9-20 ms per FSDP collective and have the least memory headroom of the rows with large FSDP buffers
    (1.2-1.55 layers' buffers; every other such row >= 1.79), as allocator retries would; no fitted row shows it,
    so it is not modelled (docs/benchmarks/published-runs.md)."""
    errors = _errors(held_out=True)
    assert statistics.median(errors) <= 0.053
    assert max(errors) <= 0.31
    assert sum(e <= 0.20 for e in errors) == 38  # 38 of 41 within 20%


def test_fsdp_rows_that_ran_fit_in_the_predicted_memory() -> None:
    """Every FSDP row ran, so each should fit. With activation checkpointing all 63 do (at most 94.8%: MPT-30b
    at sequence 8192 and micro-batch 1 on 8 H100, the rows plait overrates by 25-29%, the closest to the limit);
    7 did not while ZeRO-3 kept 18 bytes per parameter (a 16-bit shard beside the fp32 master: up to 104%).
    Without checkpointing 55 of 62 fit: MPT-1b (mbs 10-20 at 2048) and MPT-3b (mbs 3 at 8192) reach 101-104%,
    their activations and logits over-counted by a few percent."""
    runs, _ = load_runs(COLLECTED)
    full, none = [], []
    for run in runs:
        if run.group == "fsdp":
            report = run.report()
            recompute = run.plan.pipelines[0].stages[0].strategies[0].recompute
            (full if recompute == "full" else none).append((report.peak_memory_gib / report.memory_capacity_gib,
                                                            report.fits))
    assert len(full) == 63 and all(fits for _, fits in full)
    assert max(share for share, _ in full) == pytest.approx(0.948, abs=0.001)
    assert len(none) == 62 and sum(fits for _, fits in none) == 55


def test_fsdp_triton_attention_rows_follow_sequence_length() -> None:
    """llm-foundry's rows ran its Triton FlashAttention (`attention: triton`); priced with FlashAttention-2 rates
    its long sequences came out too fast (MPT-7b/3b/1b at 8192 on H100: +26%, +19%, +18%). Their errors now
    at sequence 8192 are now within 10% in 11 of 13 rows; the two others are MPT-30b at micro-batch 1."""
    mpt = [(run, pred / pub - 1) for run, pub, pred in FSDP if "llm-foundry" in run.source]
    assert len(mpt) == 116 and all(run.model.attention == "triton" for run, _ in mpt)
    long = [e for run, e in mpt if run.plan.seq_len == 8192]
    assert len(long) == 13
    assert sum(abs(e) <= 0.10 for e in long) == 11


def test_fsdp_on_hopper_is_no_longer_overrated() -> None:
    """H100 rows were all predicted 20-77% too fast; now they fall on both sides (median 4.5%)."""
    h100 = [pred / pub - 1 for run, pub, pred in FSDP if run.cluster.gpu.name == "H100-80GB"]
    assert statistics.median(abs(e) for e in h100) <= 0.08
    assert sum(e < 0 for e in h100) >= len(h100) // 4


def test_fsdp_layouts_of_a_model_rank_as_published() -> None:
    """Layouts of one model on one GPU type and sequence (GPU counts, micro-batches, recompute, ZeRO-2/3) whose
    published tokens/s per GPU differ by more than 10%: plait orders 16 of the 20 such pairs as published; the
    4 others all pair the MPT-1b run on 32 A100-40GB, published ~18% below its 16- and 64-GPU neighbours."""
    per_gpu = [(run.cluster.gpu.name, run.model.name, run.plan.seq_len, pub / run.cluster.world_size,
                pred / run.cluster.world_size) for run, pub, pred in FSDP]
    agree = disagree = 0
    for i, a in enumerate(per_gpu):
        for b in per_gpu[i + 1:]:
            if a[:3] == b[:3] and abs(a[3] / b[3] - 1) > 0.10:
                if (a[3] > b[3]) == (a[4] > b[4]):
                    agree += 1
                else:
                    disagree += 1
    assert agree >= 16 and disagree <= 4


COMPOSER_PEAK_FLOPS = {"A100-40GB": 312e12, "A100-80GB": 312e12, "H100-80GB": 1.979e15 / 2}
"""bf16 peak FLOP/s per GPU that llm-foundry's collect_results.py divides by (Composer's GPU_AVAILABLE_FLOPS in
composer/callbacks/speed_monitor.py: 'a100' 312e12, 'h100-sxm' 1.979e15 / 2)."""


def test_llm_foundry_throughput_agrees_with_its_mfu_column() -> None:
    """Each llm-foundry row's tokens/s reproduces the MFU column of its README line through llm-foundry's own
    formula (scripts/train/benchmarking/collect_results.py: (3 * 2 * NumParams * s + 3 * 4 * n_layers * d_model *
    s^2) * samples/s / (GPUs * peak)) to within 0.01 of a point in all 116 rows: no throughput is mistyped. So the
    MPT-1b run on 32 A100-40GB (+17.7%) is slow in every column of its line (MFU 45.39 vs 55.44-55.69 on 16, 64
    and 128 GPUs at the same per-GPU layout), as in every revision of the README since 2023-05-03."""
    rows = [r for r in json.loads(COLLECTED.read_text())["runs"] if "llm-foundry" in r["source"]]
    assert len(rows) == 116
    gaps = {}
    for r in rows:
        md, seq = r["model"], r["model"]["seq_len"]
        params = int(re.search(r"NumParams (\d+)", r["notes"]).group(1))
        samples_per_s = r["reported"]["tokens_per_s"] / seq
        flops_per_seq = 3 * 2 * params * seq + 3 * md["layers"] * 4 * md["hidden"] * seq**2
        mfu = 100 * flops_per_seq * samples_per_s / (r["gpus"] * COMPOSER_PEAK_FLOPS[r["gpu"]])
        gaps[r["source"]] = mfu - r["published_mfu_percent"]
    assert max(abs(g) for g in gaps.values()) < 0.01
    (slow,) = [r for r in rows if r["gpu"] == "A100-40GB" and "MPT-1b seq 2048 on 32 GPUs" in r["source"]]
    assert slow["published_mfu_percent"] == 45.39 and "not a transcription error" in slow["caveats"]


def _published_runs_script():
    return load_benchmark("published_runs")


def test_breakdown_of_the_70b_run_on_64_a100_40gb() -> None:
    """`published_runs.py --breakdown`: the held-out MPT-70b row on 64 A100-40GB (micro-batch 2, one per step)
    is published at 14.83 s a step where plait prices 11.40 s (+30.2%). The 3.4 s it lacks is not a per-step
    term of gradient accumulation 1: plait's optimizer step is 0.025 s (unfused AdamW at ~100 bytes a parameter
    would be ~0.08 s), and MPT-30b on 32 A100-40GB, also one micro-batch a step with 0.94 B parameters a GPU
    (the 70B row: 1.01 B), is within 4%. The same model at micro-batch 4 on 128 GPUs is within 4% too."""
    script = _published_runs_script()
    rows = {(r["gpu"], r["gpus"]): r for r in script.breakdown_rows("MPT-70b seq 2048")}
    slow = rows[("A100-40GB", 64)]
    assert slow["held_out"] and slow["micro_batches"] == 1
    assert slow["error"] == pytest.approx(0.302, abs=0.001)
    assert slow["published_step_s"] == pytest.approx(14.83, abs=0.01)
    assert slow["step_s"] == pytest.approx(11.40, abs=0.01)
    assert slow["time_s"]["optimizer"] == pytest.approx(0.0245, abs=0.0005)
    assert slow["published_step_s"] - slow["step_s"] > 100 * slow["time_s"]["optimizer"]
    assert abs(rows[("A100-40GB", 128)]["error"]) < 0.04
    # the least memory headroom, in one layer's FSDP buffers (gathered parameters and gradients), but MPT-30b at 8192
    assert slow["memory_gib"]["headroom_layers"] == pytest.approx(1.55, abs=0.01)
    assert rows[("A100-40GB", 128)]["memory_gib"]["headroom_layers"] == pytest.approx(1.79, abs=0.01)
    (same_ga,) = script.breakdown_rows("A100 40GB with 1600 Gbps node-node interconnect (RoCE)', row MPT-30b seq 2048 "
                                       "on 32 GPUs")
    assert same_ga["micro_batches"] == 1 and abs(same_ga["error"]) < 0.04


@pytest.mark.parametrize("args", [["--breakdown", "no such row"], ["--breakdown"]])
def test_breakdown_without_a_matching_row_says_so_in_one_line(args: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published_runs.py"), *args], capture_output=True,
                         text=True, env=env, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    (line,) = out.stdout.strip().splitlines()
    assert ("no such row" in line) if len(args) == 2 else line.startswith("--breakdown needs the text to look for")


def test_fms_fsdp_rows_hsdp_and_slow_networks() -> None:
    """IBM's fms-fsdp runs (Llama 2 7B/13B HSDP with shard groups of one node, 34B/70B FSDP; 128 A100 on 400 Gb/s
    and 96 H100 on 800 Gb/s per node, bf16 gradient reduce): median 3.7%, max 16.3% (70B at batch 2 on A100,
    held out)."""
    fms = [(run, pub, pred) for run, pub, pred in FSDP if "fms-fsdp" in run.source]
    assert len(fms) == 9 and sum(run.held_out for run, _, _ in fms) == 3
    assert sum(run.plan.pipelines[0].stages[0].strategies[0].shard == 8 for run, _, _ in fms) == 3
    assert all(run.plan.grad_reduce == "bf16" for run, _, _ in fms)
    errors = [abs(pred / pub - 1) for _, pub, pred in fms]
    assert statistics.median(errors) <= 0.04
    assert max(errors) <= 0.17


def test_llama3_rows_hold_one_layer_fewer_on_the_first_and_last_stage() -> None:
    """Dubey et al. 2024, Sec. 3.3.2: "we reduce one Transformer layer each from the first and the last stages".
    126 layers on 16 PP ranks with the assumed vpp 2: 7 layers on ranks 0 and 15, 8 on the others, so the last
    rank's output layer no longer sits on top of 8 layers. MFU error: 8K GPUs +6.0% (was -0.6%), 16K -7.5% (was
    -12.8%), 16K at 128K context +4.6% (was +1.0%)."""
    runs, _ = load_runs(COLLECTED)
    llama = [run for run in runs if run.source.startswith("Dubey")]
    assert len(llama) == 3
    errors = {}
    for run in llama:
        stages = run.plan.pipelines[0].stages
        per_rank = [sum(s.num_layers for s in stages[d::16]) for d in range(16)]
        assert per_rank == [7] + [8] * 14 + [7]
        assert (stages[0].layers, stages[-1].layers) == ((0, 3), (123, 126))
        errors[(run.cluster.world_size, run.plan.seq_len)] = relative_errors(
            run, run.report())["mfu"][2]
    assert errors[(8192, 8192)] == pytest.approx(0.060, abs=0.002)
    assert errors[(16384, 8192)] == pytest.approx(-0.075, abs=0.002)
    assert errors[(16384, 131072)] == pytest.approx(0.046, abs=0.002)


def test_megatron_p2p_costs_what_megascale_measured_for_overlapping_it() -> None:
    """MegaScale's ablation (Jiang et al. 2024, Table 3): overlapping the pipeline sends and receives took the
    175B model on 256 A100 (batch 256) from 55.5% to 58.0% MFU, i.e. the synchronous exchanges cost 4.3% of the
    step. The same layout priced with them and without: 4.1% (MEGATRON_P2P_HOLD = 3.0; 1.4% at 1.0)."""
    runs, _ = load_runs(COLLECTED)
    (run,) = [r for r in runs if "network optimizations" in r.source]
    assert run.plan.p2p == "megatron" and run.plan.global_batch == 256
    sync = run.report()
    free = simulate(run.plan.model_copy(update={"p2p": "async"}), run.model, run.cluster, run.cal)
    assert 1 - sync.mfu / free.mfu == pytest.approx(0.0413, abs=0.001)


def test_megascale_530b_rows_within_the_megatron_bar() -> None:
    """Figure 9's Megatron-LM bars (49.2/48.8/48.2% MFU): +8.4/+9.2/+10.4% (were +14.4/+15.2/+16.5%), and
    Korthikanti et al.'s measurement of the same per-pipeline work (280 GPUs, 56% MFU) stays within 1%."""
    runs, _ = load_runs(COLLECTED)
    bars = sorted((r.cluster.world_size, relative_errors(r, r.report())["mfu"][2])
                  for r in runs if "Figure 9" in r.source)
    assert [g for g, _ in bars] == [2240, 4480, 11200]
    assert [round(e, 3) for _, e in bars] == [0.084, 0.092, 0.104]
    (selective,) = [r for r in runs if "530B, selective" in r.source]
    assert abs(relative_errors(selective, selective.report())["mfu"][2]) <= 0.011


def test_a_row_whose_chunk_layers_do_not_add_up_is_skipped_with_its_reason(tmp_path: Path) -> None:
    rows = json.loads(COLLECTED.read_text())
    row = next(r for r in rows["runs"] if r["source"].startswith("Dubey"))
    row["layout"]["chunk_layers"] = [4] * 32
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [row]}))
    runs, skipped = load_runs(tmp_path / "runs.json")
    assert runs == []
    assert len(skipped) == 1 and "summing to the 126 layers" in skipped[0][1]


def _throughput(run, key: str, value: float) -> float:
    """A figure as a rate that grows with throughput: tokens per second of an iteration time, else itself (model
    FLOP/s per GPU, MFU and tokens/s are proportional to each other for one model, sequence and GPU count)."""
    return run.plan.global_batch * run.plan.seq_len / value if key == "iteration_time_s" else value


def test_two_layouts_of_one_model_on_one_cluster_rank_as_published() -> None:
    """Every pair of collected runs of the same model, sequence, GPU type and count in two layouts, compared on a
    figure both report (hardware FLOP/s and HFU left out: they count recomputation): full vs selective recompute
    (Korthikanti et al.: 22B on 8, 175B on 64, 530B on 280, 1T on 512 A100), global batch (MegaScale 175B on 256
    A100) and micro-batch under FSDP with full recompute (fms-fsdp 34B and 70B on 128 A100, batch 2 vs 8 and 6).
    plait orders all 7 as published. (The MoE rows are left out: of Qwen3-235B's three layouts on 256 H100,
    the Megatron-FSDP one is predicted 2x too slow, so it misorders two of the three pairs.)"""
    runs, _ = load_runs(COLLECTED)
    priced = [(run, run.report()) for run in runs if run.group != "moe"]
    keys = ("tokens_per_s", "model_tflops_per_gpu", "mfu", "iteration_time_s")
    pairs = []
    for i, (a, ra) in enumerate(priced):
        for b, rb in priced[i + 1:]:
            same = (a.cluster.gpu.name, a.cluster.world_size, a.model, a.plan.seq_len) == \
                (b.cluster.gpu.name, b.cluster.world_size, b.model, b.plan.seq_len)
            common = [k for k in keys if k in a.reported and k in b.reported]
            if not same or a.strategy == b.strategy or not common:
                continue
            k = common[0]
            published = _throughput(a, k, a.reported[k]) > _throughput(b, k, b.reported[k])
            predicted = _throughput(a, k, getattr(ra, k)) > _throughput(b, k, getattr(rb, k))
            pairs.append((a.source, b.source, published == predicted))
    assert len(pairs) == 7
    assert all(agree for _, _, agree in pairs), [p for p in pairs if not p[2]]


def _moe_errors() -> list[tuple[object, float]]:
    """(run, signed relative error) of every collected mixture-of-experts row (one figure each)."""
    runs, _ = load_runs(COLLECTED)
    out = []
    for run in runs:
        if run.group == "moe":
            (_, _, error), = relative_errors(run, run.report()).values()
            out.append((run, error))
    return out


MOE = _moe_errors()


def test_moe_rows_are_collected_with_a_held_out_third() -> None:
    assert len(MOE) == 21
    # every third row, and every row found later but Megatron-Bridge's Qwen3-30B-A3B A/B (two rows), whose profile
    # and times three constants were read from (Calibration.moe_exchange_overhead_s and ep_overlap_hidden,
    # experts.EXPERT_GEMM_HOST_S)
    assert sum(run.held_out for run, _ in MOE) == 10
    assert {run.cluster.gpu.name for run, _ in MOE} == {"H100-80GB"}
    assert {run.model.name for run, _ in MOE} == {"qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b", "mixtral-8x22b",
                                                   "gpt-oss-20b", "gpt-oss-120b", "deepseek-v3", "kimi-k2",
                                                   "deepseek-v3-mtp"}


def test_moe_rows_the_constants_were_chosen_on() -> None:
    """benchmarks/published_runs.py: median 4.4%, max 25.4% over 11 rows with the norms' and the expert
    activation's recompute that the Qwen3-235B (ModelZoo 'norm, act') and GPT-OSS rows ran priced
    (`Strategy.recompute_modules`); median 3.7%, max 26.6% with the A/B's overlap-on row (+0.0%, the
    share of a paired exchange Megatron's expert-parallel overlap hides, 0.46, read from it); median 6.8%, max
    26.6% over 10 rows with the dispatchers' fixed cost of each
    token exchange (0.29 ms, from the Qwen3-30B-A3B A/B's profile, the tenth row: +0.0%), the expert GEMMs' host
    time bounded by that profile (40 us, was 50) and a plain all-to-all priced as sending every routed copy across
    nodes (was: once per node, as DeepEP); before those: 12.1%, 36.8% over 9 (37.1% before the optimizer stepped the experts over
    their own shard group; before the experts' output bias: 12.1%, 55.8%; before
    the permutation passes, DeepEP's dispatch and the AutoModel rows' configs: 14.8%, 63.8%; before the dispatch
    and launch terms: 29.8%, 62.8%). The four GPT-OSS 120B rows (Megatron-Bridge, 64 H100) are predicted 33-37% too
    fast, the Mixtral-8x22B rows 10-11% too
    fast and DeepSeek-V3 on 256 GPUs 20% too fast; the issue's bar (median <= 10%, max <= 20%) is not met."""
    errors = [abs(e) for run, e in MOE if not run.held_out]
    assert statistics.median(errors) <= 0.045
    assert max(errors) <= 0.255


def test_moe_held_out_rows() -> None:
    """Median 13.4%, max 26.9% over 9 rows with Megatron-MoE-ModelZoo's Qwen3-235B '+1f1b overlap' row (-3.6%,
    priced with the overlap's hidden share read from the Megatron-Bridge A/B; 19.7 s without overlap, +3.7%);
    15.8%, 26.9% over 8 rows with the dispatchers' fixed cost of each token exchange (18.4%, 37.2%
    before it; 18.7%, 37.4% before the optimizer stepped the experts over their own
    shard group; 16.2% over 7 before AutoModel's Kimi K2 row, -21.2%, was added; 27.3% over
    5 before AutoModel's GPT-OSS 20B and 120B rows, +0.2% and -8.4%; 22.0% before the NeMo 25.11 GPT-OSS row, +27.3%; 23.3% before AutoModel's
    synchronous pipeline exchanges; before the schedule
    runs and layer split of AutoModel's DeepSeek-V3 23.7%, 37.4%;
    before the experts' output bias 23.7%, 56.1%; before the AutoModel configs 17.8%,
    64.2%; before the dispatch terms 40.3%, 99.7%): GPT-OSS 120B (+37%), DeepSeek-V3 on 1024 GPUs (-30%: +18%
    while it was priced as per-micro-batch ZeRO-3 without recompute; its config recomputes every block and syncs FSDP once per step), Mixtral-8x7B (+16%),
    Megatron-FSDP Qwen3-235B (+11%)."""
    errors = sorted(abs(e) for run, e in MOE if run.held_out)
    assert statistics.median(errors) <= 0.135
    assert max(errors) <= 0.269


def test_moe_held_out_rows_of_the_named_families_meet_the_bar() -> None:
    """The held-out rows of the set the MoE bar names (Mixtral and Qwen3 families, 64-256 H100): Megatron-LM's
    Mixtral-8x7B on 64 H100 (+9.3%), ModelZoo's Megatron-FSDP Qwen3-235B (+13.4%) and its '+1f1b overlap' row
    (-3.6%): median 9.3%, max 13.4% (bar: 10%, 20%)."""
    errors = [abs(e) for run, e in MOE if run.held_out and run.cluster.gpu.name == "H100-80GB"
              and 64 <= run.cluster.world_size <= 256 and run.model.name.startswith(("mixtral", "qwen3"))]
    assert len(errors) == 3
    assert statistics.median(errors) <= 0.10 and max(errors) <= 0.20


def test_expert_parallel_overlap_rows() -> None:
    """Megatron's --overlap-moe-expert-parallel-comm on both published pairs: Megatron-Bridge's Qwen3-30B-A3B on 16
    H100 (the hidden share is read from it: 24.71 -> 20.99 s published, +0.0% both) and ModelZoo's Qwen3-235B-A22B
    TP2 EP32 PP8 VPP4 on 256 H100 (held out: 19.7 -> 17.6 s published, 20.56 -> 17.09 s priced with the norms'
    and the expert activation's recompute the table's 'norm, act' names)."""
    pairs = {}
    for run, e in MOE:
        if run.model.name in ("qwen3-30b-a3b", "qwen3-235b-a22b") and run.plan.dispatcher == "deepep" and \
                run.plan.pipelines[0].stages[0].strategies[0].ep in (16, 32):
            pairs.setdefault(run.model.name, {})[run.plan.ep_overlap] = (run, e)
    assert set(pairs) == {"qwen3-30b-a3b", "qwen3-235b-a22b"}
    for name, pair in pairs.items():
        (off, e_off), (on, e_on) = pair[False], pair[True]
        assert on.held_out == (name == "qwen3-235b-a22b")
        assert on.report().iteration_time_s < off.report().iteration_time_s
        assert abs(e_on) <= 0.045 and abs(e_off) <= 0.045


def test_megatron_fsdp_expert_gathers_hide_behind_the_token_exchange_too() -> None:
    """Qwen3-235B, TP2 EP8 (inside a node) and FSDP over the 32 expert data-parallel ranks (across nodes), 256 H100:
    was +99.7%; the experts' gathers and reduce-scatters (InfiniBand) also run beside the dispatch and combine
    (NVLink), the row reduces gradients in bf16 as Megatron-FSDP's guide recommends (+67.1%), and it is priced as
    Megatron-FSDP (zero-copy double buffers: no per-collective hook time, contention of the SM share alone): +11.0%;
    with DeepEP's once-per-rank dispatch and its two permutation passes: +10.7%; with the dispatchers' fixed cost of
    each token exchange (`Calibration.moe_exchange_overhead_s`): +13.4%."""
    (error,) = [e for run, e in MOE if run.plan.pipelines[0].stages[0].strategies[0].zero == 3
                and run.model.name == "qwen3-235b-a22b"]
    assert round(error, 3) == 0.134


def test_cross_node_expert_parallel_rows_within_13_percent() -> None:
    """Qwen3-235B-A22B on 256 H100 with DeepEP (fully published layouts, no FSDP): EP32 across 4 nodes was
    +30% (every routed copy over InfiniBand) and TP4/EP8 with 16 small local experts -40%; then -8.8% and -12.1%;
    with DeepEP's once-per-rank dispatch and the permutation passes -5.5% and -12.1%; with the dispatchers' fixed
    cost of each token exchange and the expert GEMMs' host time at 40 us (was 50): +3.7% and -10.0%."""
    errors = [e for run, e in MOE if run.model.name == "qwen3-235b-a22b" and run.plan.pipelines[0].stages[0]
              .strategies[0].zero == 1 and not run.plan.ep_overlap]
    assert len(errors) == 2
    assert all(abs(e) <= 0.13 for e in errors)


def test_gpt_oss_rows_reduce_gradients_in_bf16_and_stay_over_20_percent_fast() -> None:
    """Megatron-Bridge's 26.02-26.04 GPT-OSS perf configs set grad_reduce_in_fp32 False (bf16 gradient reduction):
    +57.6..62.6% became +59.2..64.2%. The attention kernel is the open question: TransformerEngine runs the sink
    attention in cuDNN (fused) only from cuDNN 9.13.1, else unfused, and unfused would add ~89 ms to each
    9-layer stage's micro-batch (plait's eager kernel), more than the ~63 ms the published rate leaves. The
    all-to-all dispatcher's four permutation passes over the routed copies (16 local experts) take 8 points:
    +51.4..56.1%. Megatron's unfused output bias of the experts (fp32 bias times probability per local expert,
    `experts.expert_bias_time`) takes 18 points more: +33.2..37.4%; the optimizer stepping the experts' own shard
    (edp 2, not dp 16) +33.0..37.2%. NeMo 25.11's run at micro-batch 4 and global
    batch 512 (8 micro-batches a pipeline, a larger bubble) is +26.9%: per micro-batch the stages run about 30%
    longer than priced in both layouts, so what is missing scales with the work, not with the step. The same model
    on NeMo AutoModel (FSDP2, DeepEP, FlexAttention; 64 H100) is predicted within 8.4%, and GPT-OSS 20B there within
    0.2%: what is missing belongs to Megatron-Bridge's path, not to the model's shape. With the dispatchers' fixed
    cost of each token exchange (0.29 ms, 4 a layer and micro-batch): +23.0..26.9%. With the recompute of the
    norms and the expert activation their configs set (`Strategy.recompute_modules` layernorm+moe_act): +21.8..25.7%."""
    errors = sorted(e for run, e in MOE if run.model.name == "gpt-oss-120b" and "Megatron-Bridge" in run.source)
    assert [round(e, 3) for e in errors] == [0.218, 0.22, 0.223, 0.254, 0.257]


def test_automodel_rows_run_as_their_configs_say() -> None:
    """NeMo AutoModel's benchmark configs recompute every block where activation_checkpointing is on, sync FSDP2
    once per step where the MoE FSDP optimizations are on (reshard_after_forward false: ZeRO-1's schedule), dispatch
    with DeepEP and route with the fake balanced gate (contiguous experts). DeepSeek-V3's layers_per_stage 2 give 32
    virtual stages with the pipelining code of the table's time (ceil(61 / 2) + 1): vpp 8 as the table prints, the
    first 29 stages holding two layers (generate_hf_model_fqn_per_model_part); its 1024-GPU row's GA 4 calls the
    pipeline schedule four times a step (schedule_runs 4). GPT-OSS runs without those FSDP optimizations: 120B
    re-gathers for backward (zero 3), 20B keeps the gathered weights (zero 2). Errors: Qwen3-30B -6.3%, DeepSeek-V3
    256 GPUs -16.2% (-14.9% with the later code's vpp 7 and 28 stages), 1024 GPUs -27.7% (-27.8% with vpp 4), GPT-OSS
    120B -8.2%, 20B +0.3%. Kimi K2 (DeepSeek-V3's layer, 384 experts; pp 8, vpp 4, two schedule runs) -21.0%.
    With the dispatchers' fixed cost of each token exchange and the expert GEMMs' host time at 40 us: -0.2%, -13.6%,
    -25.5%, -4.3%, +6.9%, -18.2%."""
    auto = [(run, e) for run, e in MOE if "Automodel" in run.source]
    assert len(auto) == 6
    for run, _ in auto:
        assert (run.plan.dispatcher, run.plan.routing) == ("deepep", "contiguous")
    shapes = sorted((run.model.name, run.cluster.world_size, run.plan.chunks, run.plan.schedule_runs,
                     run.plan.pipelines[0].stages[0].strategies[0].recompute,
                     run.plan.pipelines[0].stages[0].strategies[0].zero) for run, _ in auto)
    assert shapes == [("deepseek-v3", 256, 8, 1, "full", 1), ("deepseek-v3", 1024, 8, 4, "full", 1),
                      ("gpt-oss-120b", 64, 1, 1, "none", 3), ("gpt-oss-20b", 8, 1, 1, "full", 2),
                      ("kimi-k2", 256, 4, 2, "full", 1), ("qwen3-30b-a3b", 8, 1, 1, "full", 1)]
    for run, _ in auto:
        if run.model.name in ("deepseek-v3", "kimi-k2"):
            assert [b - a for a, b in (st.layers for st in run.plan.pipelines[0].stages)] == [2] * 29 + [1] * 3
    assert sorted(round(e, 3) for _, e in auto) == [-0.255, -0.182, -0.136, -0.043, -0.002, 0.069]


def test_automodel_rows_train_in_pure_bf16_and_fit() -> None:
    """AutoModel casts its MoE models to bf16 and steps the bf16 parameters (no fp32 master, bf16 Adam moments:
    8 bytes a parameter, `bf16-pure`), reducing gradients in fp32. Priced so, every one of its rows fits the
    80 GB it ran on; priced as mixed precision (a fp32 master and moments) four did not (98.5, 82.7, 88.0 and
    88.2 GiB), with the same times to 0.5% (the bf16 optimizer step moves fewer bytes)."""
    auto = [run for run, _ in MOE if "Automodel" in run.source]
    assert {(run.plan.precision, run.plan.grad_reduce) for run in auto} == {("bf16-pure", "fp32")}
    for run in auto:
        report = run.report()
        assert report.fits, (run.model.name, report.peak_memory_gib)
        mixed = simulate(run.plan.model_copy(update={"precision": "bf16"}), run.model, run.cluster, cal=run.cal)
        assert report.iteration_time_s == pytest.approx(mixed.iteration_time_s, rel=5e-3)
        assert report.peak_memory_gib < mixed.peak_memory_gib
    over = [run.model.name for run in auto if not simulate(run.plan.model_copy(update={"precision": "bf16"}),
                                                              run.model, run.cluster, cal=run.cal).fits]
    assert sorted(over) == ["deepseek-v3", "gpt-oss-120b", "kimi-k2", "qwen3-30b-a3b"]


def test_automodel_pipelines_exchange_as_torch_2_9_interleaved_1f1b_does() -> None:
    """AutoModel's DeepSeek-V3 rows ran torch.distributed.pipelining's ScheduleInterleaved1F1B under torch
    2.8.0 (Automodel 01926a5's uv.lock; pyproject torch<=2.9.0), a PipelineScheduleMulti that waits on every
    time step's batched sends and receives before its next op (p2p=torch). Priced with asynchronous
    exchanges instead, the rows would be -19.6% and -30.7% (-22.2% and -32.9% before the dispatchers' fixed cost of
    each token exchange)."""
    deep = sorted(((run, e) for run, e in MOE if "Automodel" in run.source and run.model.name == "deepseek-v3"),
                  key=lambda item: item[0].cluster.world_size)
    assert [run.plan.p2p for run, _ in deep] == ["torch", "torch"]
    free = [next(iter(relative_errors(run, simulate(run.plan.model_copy(update={"p2p": "async"}), run.model,
                                                    run.cluster, run.cal)).values()))[2] for run, _ in deep]
    assert [round(e, 3) for e in free] == [-0.196, -0.307]
    assert all(e > f for (_, e), f in zip(deep, free, strict=True))


def test_megatron_rows_printed_after_the_causal_flop_count_are_compared_with_it() -> None:
    """Megatron-LM counts causal attention cores at half since MR !2789 (2025-03-06); the ModelZoo's Mixtral-8x22B
    figures come from its 25.06 container: plait's model TFLOP/s are scaled by 0.9663 (+15-16% became +9.6-10.8%;
    +2.5-3.6% with the dispatchers' fixed cost of each token exchange).
    The Mixtral-8x7B figure (MCore v0.9, 2024) keeps the whole count."""
    from plait.published import causal_mfu

    causal = [(run, e) for run, e in MOE if run.mfu_convention == "causal_half"]
    assert [run.model.name for run, _ in causal] == ["mixtral-8x22b", "mixtral-8x22b"]
    run = causal[0][0]
    report = run.report()
    (_, ours, _), = relative_errors(run, report).values()
    assert ours == pytest.approx(report.model_tflops_per_gpu * causal_mfu(report, run.model, 4096) / report.mfu)
    assert round(ours / report.model_tflops_per_gpu, 4) == 0.9663
    assert sorted(round(e, 3) for _, e in causal) == [0.025, 0.036]


def test_megatron_fsdp_row_runs_at_its_infiniband_time() -> None:
    """Qwen3-235B with Megatron-FSDP (TP2, EP8 in a node, 256 H100, mbs 4 x GA 4): per layer and micro-batch the
    published 17.6 s is 46.8 ms, and the rank's InfiniBand carries 3 expert collectives (gather for forward, gather
    for backward, reduce-scatter) over its 32 expert data-parallel peers, one per node, plus the same 3 for its
    dense shard over 128 ranks: 44.0 ms. The run is link-bound with its compute hidden, which PyTorch FSDP's
    contention (0.6) and per-collective hook time (1.5 ms) cannot give (+67.1%); Megatron-FSDP's are smaller."""
    from plait.cost import comm
    from plait.cost.calibration import calibration_for
    from plait.cost.experts import expert_params, expert_params_per_rank

    (run,) = [run for run, _ in MOE if run.model.name == "qwen3-235b-a22b"
              and run.plan.pipelines[0].stages[0].strategies[0].zero == 3]
    s = run.plan.pipelines[0].stages[0].strategies[0]
    block = next(b for b in run.model.stack if b.kind == "moe")
    cal = calibration_for(run.cluster.gpu.name)
    experts = comm.all_gather(expert_params_per_rank(block, s) * 2, comm.GroupShape(32, 32, 1), run.cluster, cal)
    dense = comm.all_gather((block.params - expert_params(block)) / s.tp * 2, comm.GroupShape(128, 32, 4),
                            run.cluster, cal)
    link_ms = 3 * (experts + dense) * 1e3
    published_ms = 17.6 / (94 * 4) * 1e3
    assert round(link_ms, 1) == 44.0
    assert round(published_ms, 1) == 46.8


def test_megatron_fsdp_calibration_is_the_sm_share_without_hook_time() -> None:
    from plait.cost.calibration import calibration_for, megatron_fsdp
    from plait.spec.cluster import dgx

    for gpu, share in (("H100-80GB", 24 / 132), ("A100-80GB", 24 / 108)):
        cluster = dgx(1, 8, gpu)
        cal = megatron_fsdp(calibration_for(gpu), cluster.gpu)
        assert cal.overlap_contention == pytest.approx(share)
        assert cal.fsdp_collective_overhead_s == 0.0
        assert cal.gemm_efficiency == calibration_for(gpu).gemm_efficiency


def test_only_the_megatron_fsdp_row_gets_its_calibration() -> None:
    runs, _ = load_runs(COLLECTED)
    priced = [run for run in runs if run.cal is not None]
    assert [(run.model.name, run.held_out) for run in priced] == [("qwen3-235b-a22b", True)]


def test_an_unknown_fsdp_runtime_is_skipped_with_its_reason(tmp_path: Path) -> None:
    import json

    data = json.loads(COLLECTED.read_text())
    row = next(r for r in data["runs"] if r["layout"].get("fsdp_runtime") == "megatron")
    row["layout"]["fsdp_runtime"] = "deepspeed"
    path = tmp_path / "runs.json"
    path.write_text(json.dumps({"runs": [row]}))
    runs, skipped = load_runs(path)
    assert runs == []
    assert skipped == [(row["source"], "fsdp_runtime 'deepspeed' is not one of torch, megatron")]


def _offload_rows() -> list:
    runs, _ = load_runs(COLLECTED)
    return [run for run in runs if run.group == "offload"]


def test_offload_rows_come_from_the_chosen_sources_and_are_all_held_out() -> None:
    """The offload and long-context group is collected by the rule in the data file's `offload_sources`
    (sources chosen first, every qualifying figure of each taken): 9 sources, 2 rows (ZeRO-Offload 10B on one
    V100, MEMO 7B at 1M tokens on 8 A800); each row cites exactly one chosen source, and every source's `rows`
    is the number of rows citing it."""
    sources = json.loads(COLLECTED.read_text())["offload_sources"]
    assert all(part in sources["rule"] for part in ("(1)", "(2)", "(3)", "(4)"))
    chosen = sources["chosen"]
    rows = _offload_rows()
    assert len(chosen) == 9 and len(rows) == 2 and all(run.held_out for run in rows)
    for run in rows:
        assert sum(s["cite_key"] in run.source for s in chosen) == 1, run.source
    for s in chosen:
        assert sum(s["cite_key"] in run.source for run in rows) == s["rows"], s["source"]
        assert s["rows"] or s["excluded"], f"{s['source']}: no row and no reason"


def test_offload_group_errors() -> None:
    """ZeRO-Offload 10B: +16.4% (hardware TFLOP/s); MEMO 7B at 1M tokens: -14.7% (MFU, causal half):
    median 15.6%, max 16.4%, above the group's median bar of 15%."""
    errors = sorted(err for run in _offload_rows()
                    for _, _, err in relative_errors(run, run.report()).values())
    assert errors == pytest.approx([-0.147, 0.164], abs=0.001)
    assert statistics.median(abs(e) for e in errors) == pytest.approx(0.156, abs=0.001)


def test_deepseek_v3_with_its_mtp_module_and_module_recompute_on_1024_h100() -> None:
    """Megatron-Bridge's DeepSeek-V3 model card on 1,024 H100 (61.756 s a step; held out): one multi-token-
    prediction module in its own last chunk (layout Et|(tt|)*30mL), the latent up-projections and the dense MLPs
    recomputed (`recompute_modules` mla_up_proj+mlp), HybridEP priced as the deepep dispatcher: 58.29 s, -5.6%."""
    (run, e), = [(run, e) for run, e in MOE if run.model.name == "deepseek-v3-mtp"]
    assert run.held_out and run.model.mtp_layers == 1 and run.plan.pipelines[0].stages[0].strategies[0].recompute_modules == \
        ("mla_up_proj", "mlp")
    assert not run.plan.overlap_grad_reduce and run.plan.chunks == 4
    assert [st.layers[1] - st.layers[0] for st in run.plan.pipelines[0].stages][-1] == 1  # the module alone
    assert round(e, 3) == -0.056
