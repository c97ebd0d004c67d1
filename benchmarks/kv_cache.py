"""Selective KV caches on a real model, every method side by side: SmolLM2-135M-Instruct on this CPU.

    python benchmarks/kv_cache.py                                  # 2K and 4K contexts, budgets 1/5 and 1/10
    python benchmarks/kv_cache.py --contexts 2048 --budgets 0.2    # quicker

For each context and budget: pass-key retrieval over DEPTHS positions (5-digit keys in filler text), the
perplexity of CONTINUATION tokens of the King James Bible's Genesis after CONTEXT tokens of it (each token
decoded over the method's selection), top-k recall of PQCache's selection against exact attention scores,
decode milliseconds per token, and the KV bytes the accelerator would hold between steps (PQ codes and
centroids; H2O's and SnapKV's kept rows; the window; the whole KV for full attention). `full` is
transformers' own attention and cache, the reference.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from plait.cli import print_kv_rows
from plait.inference.config import PQCacheConfig
from plait.inference.evaluate import default_text, evaluate, load

METHODS = ("pqcache", "snapkv", "h2o", "window")
console = Console(width=170)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--budgets", default="0.2,0.1")
    ap.add_argument("--depths", type=int, default=5)
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "kv_cache.json")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    budgets = [float(b) for b in args.budgets.split(",")]
    model, tokenizer = load()
    text = default_text()
    runs = [(c, PQCacheConfig(method="full")) for c in contexts]
    runs += [(c, PQCacheConfig(method=m, budget=b, measure_recall=m == "pqcache"))
             for c in contexts for b in budgets for m in METHODS]
    rows = []
    steps = args.depths + args.continuation
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("", total=len(runs) * steps)
        for context, config in runs:
            bar.update(task, description=f"{config.method} {config.budget:g} at {context}")
            rows.append(evaluate(model, tokenizer, config, context, args.depths, args.continuation, text,
                                 progress=lambda: bar.advance(task)))
    print_kv_rows(rows)
    for context in contexts:
        full = next(r for r in rows if r["context"] == context and r["method"] == "full")
        for budget in budgets:
            pq = next(r for r in rows if r["context"] == context and r["method"] == "pqcache" and r["budget"] == budget)
            console.print(f"{context} tokens, budget {budget:g}: PQCache pass key {pq['passkey_found']}/"
                          f"{pq['passkey_trials']} (full {full['passkey_found']}/{full['passkey_trials']}), "
                          f"perplexity {pq['perplexity'] / full['perplexity']:.3f}x full, decode "
                          f"{pq['decode_s_per_token'] / full['decode_s_per_token']:.2f}x full, recall "
                          f"{pq['topk_recall']:.2f}, KV near the device {pq['kv_resident_bytes'] / full['kv_full_bytes']:.1%}"
                          " of full")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    tmp.replace(args.out)


if __name__ == "__main__":
    main()
