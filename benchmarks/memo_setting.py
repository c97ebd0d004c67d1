"""MEMO's setting (Zhao et al., SIGMOD 2025): a 7B GPT at 1,048,576 tokens on 8 A800-80GB, beside MEMO's 52.3% MFU.

    python benchmarks/memo_setting.py

Searches the best plan with the memory hierarchy (swap, optimizer offload) and the best without it, and prints
each plan's MFU in both attention conventions: counted whole (Megatron's formula, plait's MFU) and with causal
attention halved (`plait.published.causal_mfu`). MEMO's own convention is not confirmed from its retrievable text.
"""

from __future__ import annotations

from dataclasses import replace

from rich.console import Console
from rich.table import Table

from plait.planner.engine import DEFAULT_LIMITS, search
from plait.planner.space import HIERARCHY
from plait.published import causal_mfu
from plait.spec.cluster import load_cluster
from plait.spec.model import load_model

SEQ = 1048576
MEMO_MFU = 0.523
"""MEMO's MFU for this setting (arXiv 2407.12117, abstract: "achieving an MFU of 52.30%")."""


def main() -> None:
    model = replace(load_model(f"gpt:layers=32,hidden=4096,heads=32,ffn=16384,vocab=50257,max_seq_len={SEQ}"),
                    learned_positions=False)
    cluster = load_cluster("1x8xA800-80GB")
    table = Table(title="MEMO's setting: 7B GPT, 1M tokens, 8 A800-80GB")
    for col in ("plans searched", "fits", "MFU (attention whole)", "MFU (causal halved)", "HFU", "s/iter",
                "host GiB", "plan"):
        table.add_column(col)
    for label, limits in (("with swap / offload", replace(DEFAULT_LIMITS, **HIERARCHY)),
                          ("without", DEFAULT_LIMITS)):
        found = search(model, cluster, SEQ, 1, limits=limits)
        if found.report is None:
            table.add_row(label, "no plan fits", "-", "-", "-", "-", "-", "-")
            continue
        r = found.report
        plan = sorted({s.short() for st in found.plan.pipelines[0].stages for s in st.strategies})
        table.add_row(label, str(r.fits), f"{r.mfu:.1%}", f"{causal_mfu(r, model, SEQ):.1%}", f"{r.hfu:.1%}",
                      f"{r.iteration_time_s:.0f}", f"{r.host_memory_gib:.0f}", "; ".join(plan))
    table.add_row("MEMO (published)", "yes", f"{MEMO_MFU:.1%}", "", "", "", "", "convention not confirmed")
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
