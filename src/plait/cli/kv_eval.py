"""`plait kv-eval`: measure a selective KV cache on a real model."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.table import Table

from plait.cli.common import JsonOpt, app, one_line_errors, out, print_json, search_progress
from plait.errors import PlaitError


@app.command(name="kv-eval")
def kv_eval_cmd(
    method: Annotated[str, typer.Option("--method", help="pqcache | full | window | h2o | snapkv")] = "pqcache",
    budget: Annotated[float, typer.Option("--budget", help="tokens a decode step reads: a fraction of the "
                                          "context (< 1) or a count")] = 0.2,
    context: Annotated[int, typer.Option("--context", help="prompt tokens")] = 2048,
    depths: Annotated[int, typer.Option("--depths", help="pass-key positions, start to end")] = 5,
    continuation: Annotated[int, typer.Option("--continuation", help="tokens scored for perplexity")] = 64,
    text: Annotated[Path | None, typer.Option("--text", help="long text for perplexity (default: KJV Genesis)")] = None,
    model_dir: Annotated[Path | None, typer.Option(
        "--model-dir", help="a Hugging Face Llama-family model directory (default: SmolLM2-135M-Instruct)")] = None,
    gguf: Annotated[str | None, typer.Option("--gguf", help="a GGUF file in --model-dir")] = None,
    subspaces: Annotated[int, typer.Option("--subspaces", help="pqcache: sub-spaces per key")] = 8,
    bits: Annotated[int, typer.Option("--bits", help="pqcache: 2^bits centroids per sub-space")] = 6,
    seed: Annotated[int, typer.Option("--seed", help="seed of the pass keys")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Measure a selective KV cache on a real model: pass-key retrieval over positions, continuation
    perplexity, top-k recall, decode latency, KV bytes and peak memory."""
    with one_line_errors():
        config = _config(method, budget, subspaces, bits)
        _check_inputs(config, method, budget, context, depths, continuation, text)
        _check_model_dir(model_dir, gguf)
        from plait.inference.evaluate import check_inputs, default_text, evaluate, load

        body = text.read_text(errors="replace") if text else default_text()
        model, tokenizer = load(model_dir, gguf)
        check_inputs(model, tokenizer, config, context, continuation, body)
        bar, update = search_progress("{}")
        total = depths + continuation
        count = [0]

        def tick() -> None:
            count[0] += 1
            update(f"{method} at {context} tokens", count[0], total)

        with bar:
            row = evaluate(model, tokenizer, config, context, depths, continuation, body, seed, tick)
    if as_json:
        print_json(row)
        return
    print_kv_rows([row])


def _config(method: str, budget: float, subspaces: int, bits: int):
    """The cache's PQCacheConfig; an invalid option becomes a one-line PlaitError naming it."""
    from pydantic import ValidationError

    from plait.inference.config import PQCacheConfig

    try:
        return PQCacheConfig(method=method, budget=budget, subspaces=subspaces, bits=bits,
                             measure_recall=method == "pqcache")
    except ValidationError as exc:
        first = exc.errors()[0]
        raise PlaitError(f"--{'-'.join(map(str, first['loc'])) or 'method'}: {first['msg']}") from None


def _check_inputs(config, method: str, budget: float, context: int, depths: int, continuation: int,
                  text: Path | None) -> None:
    if context < 64 or depths < 1 or continuation < 1:
        raise PlaitError("--context must be >= 64 tokens, --depths and --continuation >= 1")
    if method != "full" and config.tokens(context) >= context:
        raise PlaitError(f"--budget {budget:g} keeps all {context} tokens of the context; that is --method full, "
                         "or give a smaller budget")
    if text is not None and not text.is_file():
        why = "is a directory" if text.is_dir() else "does not exist"
        raise PlaitError(f"--text {str(text)!r} {why}; give a long plain-text file")


def _check_model_dir(model_dir: Path | None, gguf: str | None) -> None:
    """kv-eval's model: a directory that exists, and a --gguf file inside it."""
    if model_dir is None:
        if gguf:
            raise PlaitError("--gguf names a file in --model-dir; give --model-dir DIR too")
        return
    if not model_dir.is_dir():
        raise PlaitError(f"--model-dir {str(model_dir)!r} is not a directory; give a Hugging Face model directory")
    if gguf and not (model_dir / gguf).is_file():
        raise PlaitError(f"--gguf {gguf!r} is not a file in {str(model_dir)!r}; give the name of a .gguf file there")


def print_kv_rows(rows: list[dict]) -> None:
    """Selective-cache measurements side by side, one row per (method, budget, context)."""
    table = Table(title="selective KV caches (decode reads the budget; full = native attention)", box=box.SIMPLE_HEAD)
    for col in ("context", "method", "budget", "pass key", "by depth", "perplexity", "top-k recall",
                "decode ms/token", "prefill s", "KV MiB (all)", "KV MiB near device", "peak RSS MiB"):
        table.add_column(col, justify="left" if col in ("method", "by depth") else "right")
    for r in rows:
        depth = "".join("+" if ok else "-" for ok in r["passkey_by_depth"].values())
        recall = f"{r['topk_recall']:.2f}" if r["topk_recall"] is not None else "-"
        table.add_row(str(r["context"]), r["method"], "-" if r["method"] == "full" else f"{r['budget']:g}",
                      f"{r['passkey_found']}/{r['passkey_trials']}", depth, f"{r['perplexity']:.2f}", recall,
                      f"{r['decode_s_per_token'] * 1e3:.1f}", f"{r['prefill_s']:.1f}",
                      f"{r['kv_full_bytes'] / 2**20:.1f}", f"{r['kv_resident_bytes'] / 2**20:.2f}",
                      f"{r['peak_rss_bytes'] / 2**20:,.0f}")
    out.print(table)
