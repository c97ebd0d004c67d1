"""LSH-MoE, simulated: one training iteration with plain expert-parallel all-to-alls against moe_comm=lsh.

    python benchmarks/lsh_moe.py

Settings after the paper (Nie et al., NeurIPS 2024, arXiv 2411.08446): RoBERTa-MoE, GPT-MoE and T5-MoE
trained with expert parallelism on 16 and 32 GPUs (2 and 4 nodes of 8), compression rates 10-20% (Fig. 7).
The model shapes below are base-size stand-ins (the paper's Table 1 was not retrievable here: layers,
widths and expert counts are assumptions, MoE in every other layer, top-2, one expert per GPU), on
A100-40GB nodes with two networks: 200 Gb/s per GPU between nodes (plait's DGX default), and 100 Gb/s per
node (12.5 Gb/s per GPU), a commodity network where the all-to-alls take a share of the iteration like
the paper's measured 45% (its Fig. 3). The paper reports 1.28-2.2x
end to end (RoBERTa-MoE 1.6x and T5-MoE 2.2x in time to a perplexity, which also counts its accuracy;
the simulator gives iteration time only).
"""

from __future__ import annotations

from plait.cost import experts
from plait.cost.layer import block_time
from plait.cost.price import price
from plait.plan import uniform_plan
from plait.simulate import simulate
from dataclasses import replace

from plait.spec.cluster import Link, dgx
from plait.spec.model import parse_inline

MODELS = {  # name: inline spec (assumed shapes; see the docstring)
    "RoBERTa-MoE": "llama:layers=12,hidden=768,heads=12,ffn=3072,vocab=50265,experts={e},top_k=2,"
                   "expert_ffn=3072,moe_every=2",
    "GPT-MoE": "llama:layers=12,hidden=768,heads=12,ffn=3072,vocab=50257,experts={e},top_k=2,expert_ffn=3072,"
               "moe_every=2",
    "T5-MoE": "llama:layers=16,hidden=1024,heads=16,ffn=4096,vocab=32128,experts={e},top_k=2,expert_ffn=4096,"
              "moe_every=2",
}
PAPER = "1.28-2.2x end to end (RoBERTa-MoE 1.6x, T5-MoE 2.2x)"
RATES = (0.1, 0.2)
SEQ, SEQS_PER_GPU = 512, 8
NETWORKS = {"200Gb/GPU": None, "100Gb/node": 100e9 / 8 / 8}
"""Inter-node bytes/s per GPU (None: the DGX default)."""


def iteration(spec: str, gpus: int, network: float | None, comm: str, rate: float) -> tuple[float, float]:
    """(seconds per iteration, share of it in expert all-to-alls) of `spec` on `gpus` A100s, dp = ep = gpus."""
    experts.LSH_COMPRESSION_RATE = rate  # the cost model reads the module constant
    block_time.cache_clear()
    price.cache_clear()
    model = parse_inline(spec.format(e=gpus))
    cluster = dgx(gpus // 8, 8, "A100-40GB")
    if network is not None:
        cluster = replace(cluster, inter=Link(network, cluster.inter.latency))
    plan = uniform_plan(f"dp={gpus},ep={gpus},moe_comm={comm},gbs={gpus * SEQS_PER_GPU},mbs={SEQS_PER_GPU}",
                        model, cluster, SEQ)
    report = simulate(plan, model, cluster)
    return report.iteration_time_s, report.breakdown.get("ep_comm", 0.0) / report.iteration_time_s


def main() -> None:
    print(f"{'model':12} {'network':>10} {'GPUs':>4} {'plain s':>12} {'a2a share':>9} " +
          " ".join(f"{f'lsh@{r:.0%} s':>10} {'speed-up':>8}" for r in RATES) + f"   paper: {PAPER}")
    for net, bandwidth in NETWORKS.items():
        for name, spec in MODELS.items():
            for gpus in (16, 32):
                base, share = iteration(spec, gpus, bandwidth, "alltoall", 1.0)
                cells = []
                for rate in RATES:
                    t, _ = iteration(spec, gpus, bandwidth, "lsh", rate)
                    cells.append(f"{t:>10.3f} {base / t:>7.2f}x")
                print(f"{name:12} {net:>10} {gpus:>4} {base:>12.3f} {share:>9.0%} " + " ".join(cells))


if __name__ == "__main__":
    main()
