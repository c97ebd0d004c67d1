"""README.md and docs/: every `plait ...` command line shown in a code block parses with the real command-line
parser (parsed only, never run), and every relative link resolves to a file (and to a heading, for `#anchor`)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import typer

from plait import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"`[^`]*`")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
UsageError = typer.BadParameter.__bases__[0]  # click's UsageError, from the click that typer uses


def split_blocks(text: str) -> tuple[list[list[str]], list[str]]:
    """(the fenced code blocks as lists of lines, the prose lines outside them)."""
    blocks: list[list[str]] = []
    prose: list[str] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if FENCE.match(line):
            if current is None:
                current = []
            else:
                blocks.append(current)
                current = None
        elif current is not None:
            current.append(line)
        else:
            prose.append(line)
    return blocks, prose


def command_lines(text: str) -> list[str]:
    """The `plait ...` command lines of a page's code blocks, continuation lines (`\\`) joined."""
    found = []
    for block in split_blocks(text)[0]:
        joined: list[str] = []
        for line in block:
            if joined and joined[-1].endswith("\\"):
                joined[-1] = joined[-1][:-1] + " " + line.strip()
            else:
                joined.append(line.strip())
        found += [line.removeprefix("$ ") for line in joined if line.removeprefix("$ ").startswith("plait ")]
    return found


def parse_command(line: str) -> None:
    """Parse one `plait ...` line with the CLI's own parser, as `plait` would, without running the command;
    a UsageError (unknown command or option, missing or malformed value) when it does not parse."""
    argv = shlex.split(line, comments=True)[1:]
    group = typer.main.get_command(cli.app)
    with group.context_class(group, info_name="plait") as ctx:
        name, command, rest = group.resolve_command(ctx, argv)  # a UsageError for an unknown command
        assert name is not None and command is not None, f"no command in {line!r}"
        with command.make_context(name, rest, parent=ctx):
            pass


def slug(heading: str) -> set[str]:
    """Anchors a heading gets: MkDocs' (Python-Markdown toc) and GitHub's spelling."""
    text = re.sub(r"`|\*\*|\*|_", "", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)).strip().lower()
    mkdocs = re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", text)).strip("-")
    github = re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))
    return {mkdocs, github}


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    for line in split_blocks(page.read_text())[1]:
        m = HEADING.match(line)
        if m:
            out |= slug(m.group(2))
    return out


def broken_links(page: Path) -> list[str]:
    """Each relative link of `page` (outside code) whose file or `#anchor` does not exist; links from docs/
    must also stay inside docs/, as the site build requires."""
    problems = []
    for line in split_blocks(page.read_text())[1]:
        for target in LINK.findall(INLINE_CODE.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            if not dest.exists():
                problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
                continue
            if DOCS in page.parents and DOCS not in dest.parents:
                problems.append(f"{page.relative_to(ROOT)}: {target}: leaves docs/ (the site cannot link it)")
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{page.relative_to(ROOT)}: {target}: no heading with anchor #{anchor}")
    return problems


COMMANDS = [(page.relative_to(ROOT).as_posix(), line) for page in PAGES for line in command_lines(page.read_text())]


def test_usage_error_is_clicks() -> None:
    assert UsageError.__name__ == "UsageError"


def test_pages_show_commands() -> None:
    shown = {line.split()[1] for _, line in COMMANDS}
    assert {"simulate", "plan", "varlen", "profile", "train", "kv-eval"} <= shown


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{line[:60]}" for p, line in COMMANDS])
def test_command_line_parses(page: str, line: str) -> None:
    try:
        parse_command(line)
    except UsageError as exc:
        pytest.fail(f"{page}: `{line}` does not parse: {exc.format_message()}")


def test_parser_check_catches_bad_lines() -> None:
    for bad in ("plait simulate --model llama2-7b --cluster 1x8xA100-80GB --no-such-option",
                "plait simulate --cluster 1x8xA100-80GB",  # --model is required
                "plait plan --model llama2-7b --cluster 1x8xA100-80GB --global-batch many",
                "plait no-such-command"):
        with pytest.raises(UsageError):
            parse_command(bad)


def test_command_lines_join_continuations_and_drop_comments() -> None:
    text = "```bash\nplait models   # presets\n$ plait plan -m x \\\n  -c 1x8xA100-80GB -b 8\necho plait\n```\n"
    assert command_lines(text) == ["plait models   # presets", "plait plan -m x  -c 1x8xA100-80GB -b 8"]
    parse_command(command_lines(text)[0])


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_link_check_catches_broken_links(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "there.md").write_text("# A heading: with `code`\n\n## Second part\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#second-part) [ok](there.md#a-heading-with-code) "
                    "[ok](#local) [web](https://example.org/x)\n\n# Local\n\n"
                    "[gone](missing.md) [bad anchor](there.md#nowhere)\n"
                    "```\n[in code](not-checked.md)\n```\n")
    assert broken_links(page) == ["page.md: missing.md: no such file",
                                  "page.md: there.md#nowhere: no heading with anchor #nowhere"]


def plan_examples(text: str) -> list[str]:
    """JSON code blocks that hold a plan (they have "pipelines")."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "```json":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            block = "\n".join(lines[i + 1:end])
            if '"pipelines"' in block:
                out.append(block)
    return out


PLANS = [(page.relative_to(ROOT).as_posix(), plan) for page in PAGES for plan in plan_examples(page.read_text())]


@pytest.mark.parametrize(("page", "text"), PLANS, ids=[p for p, _ in PLANS])
def test_plan_examples_are_valid_plans(page: str, text: str) -> None:
    from plait.plan import Plan, validate_plan
    from plait.spec.cluster import load_cluster
    from plait.spec.model import load_model

    plan = Plan.model_validate_json(text)
    validate_plan(plan, load_model(plan.model), load_cluster("1x8xA100-80GB"))


def test_every_page_is_in_the_site_navigation() -> None:
    """`make docs` builds in strict mode, which fails on a page left out of mkdocs.yml's nav."""
    root = Path(__file__).resolve().parent.parent
    nav = (root / "mkdocs.yml").read_text()
    pages = sorted(str(p.relative_to(root / "docs")) for p in (root / "docs").rglob("*.md"))
    assert pages and [p for p in pages if f"- {p}" not in nav and f": {p}" not in nav] == []
