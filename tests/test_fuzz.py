"""Property-based fuzzing of the command line, in-process: whatever the strategy string, inline model spec,
cluster string or plan file, `plait` exits 0 or prints one `error:` line and exits 2, never a traceback."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from helpers import ANSI
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from plait.cli import app
from plait.plan import uniform_plan
from plait.spec.cluster import load_cluster
from plait.spec.model import load_model

runner = CliRunner()
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

NUMBERS = st.one_of(st.integers(-3, 64), st.sampled_from(["0", "-0", "1e3", "2.5", "nan", "inf", "", " ", "x",
                                                          str(10**18), str(2**63), "0x10", "٣"]))
WORDS = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_=,:;[]{}-.0123456789 ", max_size=12)


def clean(*args: str) -> None:
    """The run ended in exit 0, or in exit 2 with exactly one `error:` line on stderr; nothing escaped."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    stderr = ANSI.sub("", result.stderr)
    if result.exit_code == 0:
        if "--json" in args:
            json.loads(result.stdout)
        return
    assert result.exit_code == 2, (args, result.exit_code, stderr)
    lines = [line for line in stderr.strip("\n").split("\n") if not line.startswith("note:")]
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, stderr)


PLAUSIBLE = st.sampled_from(["1", "2", "4", "8", "16", "0", "none", "full", "selective", "ring", "ulysses", "bf16",
                              "fp32", "1f1b", "gpipe", "interleaved", "on", "off"])


def pairs(keys: list[str], base: str = ""):
    """`base` followed by comma-joined key=value items over `keys` (and a few others): mostly plausible
    values, some numbers or words that are not."""
    item = st.tuples(st.sampled_from([*keys, "foo", "", " tp"]), st.one_of(PLAUSIBLE, PLAUSIBLE, NUMBERS.map(str), WORDS),
                     st.sampled_from(["=", "=", "=", "=", ":", ""]))
    return st.lists(item, max_size=4).map(lambda xs: ",".join([base] * bool(base) + [f"{k}{eq}{v}" for k, v, eq in xs]))


STRATEGY_KEYS = ["tp", "pp", "dp", "cp", "mbs", "gbs", "recompute", "sp", "zero", "vpp", "schedule", "cp_mode",
                 "precision", "overlap"]
MODEL_KEYS = ["layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "head_dim", "window", "experts"]


@FUZZ
@given(pairs(STRATEGY_KEYS))
def test_strategy_strings(text: str) -> None:
    clean("simulate", "--model", "tiny-gpt", "--cluster", "1x8xA100-80GB", "--seq-len", "128", "--strategy", text,
          "--json")


@FUZZ
@given(st.sampled_from(["gpt:", "llama:", "gpt:", "llama:", "t5:", "moe:", "", "gpt"]),
       st.one_of(pairs(MODEL_KEYS), pairs(MODEL_KEYS, "layers=4,hidden=64,heads=4,vocab=128")))
def test_inline_model_specs(family: str, text: str) -> None:
    clean("simulate", "--model", family + text, "--cluster", "1x8xA100-80GB", "--seq-len", "64", "--strategy",
          "dp=8", "--json")


@FUZZ
@given(NUMBERS.map(str), NUMBERS.map(str),
       st.one_of(st.sampled_from(["A100-80GB", "A100-40GB", "H100-80GB", "H200-141GB", "CPU", "a100"]), WORDS),
       st.sampled_from(["x", "X", "*", ""]))
def test_cluster_strings(nodes: str, gpus: str, kind: str, sep: str) -> None:
    clean("simulate", "--model", "tiny-gpt", "--cluster", f"{nodes}{sep}{gpus}{sep}{kind}", "--seq-len", "128",
          "--strategy", "dp=1", "--json")


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-5, 10**20), st.floats(allow_nan=False),
                                     WORDS), lambda inner: st.lists(inner, max_size=3) |
                           st.dictionaries(WORDS, inner, max_size=3), max_leaves=6)
BASE_PLAN = json.loads(uniform_plan("pp=2,tp=2,dp=2,mbs=1,gbs=8", load_model("tiny-gpt"),
                                    load_cluster("1x8xA100-80GB"), 128).to_json())


def _paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) into a JSON value."""
    found = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _paths(v, (*prefix, i))
    return found


PLAN_PATHS = [p for p in _paths(BASE_PLAN) if p]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(PLAN_PATHS), st.one_of(JSON_VALUES, st.just("<drop>"))), max_size=3),
       st.sampled_from([".json", ".yaml", ".txt"]))
def test_plan_files(edits: list[tuple[tuple, object]], suffix: str) -> None:
    plan = json.loads(json.dumps(BASE_PLAN))
    for path, value in edits:
        node = plan
        try:
            for key in path[:-1]:
                node = node[key]
            if value == "<drop>":
                del node[path[-1]]
            else:
                node[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"plan{suffix}"
        file.write_text(json.dumps(plan))
        clean("simulate", "--model", "tiny-gpt", "--cluster", "1x8xA100-80GB", "--plan", str(file), "--json")
