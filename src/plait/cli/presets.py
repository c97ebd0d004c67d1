"""`plait models` and `plait clusters`: the model presets and GPU types."""

from __future__ import annotations

from rich.table import Table

from plait.cli.common import app, out
from plait.spec.cluster import GIB, GPUS
from plait.spec.model import PRESETS


@app.command()
def models() -> None:
    """List model presets."""
    table = Table(title="model presets (or a config.json path, or gpt:/llama: inline specs)")
    for col in ("name", "family", "params", "layers", "hidden", "heads", "kv", "ffn", "vocab", "seq"):
        table.add_column(col, justify="left" if col in ("name", "family") else "right")
    for name, m in PRESETS.items():
        table.add_row(name, m.family, f"{m.params / 1e9:.2f}B" if m.params > 1e8 else f"{m.params / 1e6:.2f}M",
                      str(m.layers), str(m.hidden), str(m.heads), str(m.kv_heads), str(m.ffn), str(m.vocab),
                      str(m.max_seq_len))
    out.print(table)


@app.command()
def clusters() -> None:
    """List GPU types (use NODESxGPUSxTYPE, e.g. 2x8xH100-80GB, or a YAML file)."""
    from plait.spec.cluster import DGX_GPUS_PER_NODE, DGX_LINKS, default_host

    table = Table(title="GPU types (clusters: NODESxGPUSxTYPE such as 192x8xA100-80GB, or a YAML file)")
    for col in ("type", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "NVLink GB/s", "network GB/s per GPU",
                "host GB per 8 GPUs", "host link GB/s per GPU", "NVMe TB / GB/s per 8 GPUs"):
        table.add_column(col, justify="left" if col == "type" else "right")
    for name, g in GPUS.items():
        intra, inter = DGX_LINKS[name]
        host = default_host(name, DGX_GPUS_PER_NODE)
        table.add_row(name, f"{g.peak_flops / 1e12:.0f}", f"{g.memory_bytes / GIB:.1f}",
                      f"{g.hbm_bandwidth / 1e9:.0f}", f"{intra.bandwidth / 1e9:.0f}", f"{inter.bandwidth / 1e9:.0f}",
                      f"{host.memory_bytes / 1e9:.0f}", f"{host.link.bandwidth / 1e9:.1f}",
                      f"{host.nvme_bytes / 1e12:.1f} / {host.nvme_bandwidth / 1e9:.0f}")
    out.print(table)
