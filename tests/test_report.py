"""The HTML report page (`plait report`, `--report` on simulate and plan): self-contained, its embedded numbers
equal the `--json` report, and in headless Chromium it loads without console errors, clicking an alternative
updates the timeline, and a screenshot is not blank.

Chromium is Debian's `chromium` package: installed here with apt-get when absent and running as root; the
browser tests skip (with the reason) only where it cannot be installed.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import assert_bad_input
from typer.testing import CliRunner

from plait.cli import app
from plait.report import embedded_data, pareto_front

runner = CliRunner()
SIMULATE = ["simulate", "--model", "llama2-7b", "--cluster", "1x8xA100-80GB", "--seq-len", "2048",
            "--strategy", "tp=2,pp=2,vpp=2,dp=2,gbs=64"]
PLAN = ["plan", "--model", "gpt3-1.3b", "--cluster", "1x4xA100-80GB", "--seq-len", "2048", "--global-batch", "16",
        "--compare"]
ERRORS = "<script>window.__errors = []; addEventListener('error', e => __errors.push(String(e.message))); " \
         "const __log = console.error; console.error = (...a) => { __errors.push(a.join(' ')); __log(...a); };</script>"


def run(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.fixture(scope="module")
def plan_page(tmp_path_factory) -> tuple[Path, dict]:
    """A `plait plan --compare --json --report` run: (the page, the JSON it printed)."""
    page = tmp_path_factory.mktemp("report") / "plan.html"
    return page, json.loads(run(*PLAN, "--json", "--report", str(page)))


def test_pareto_front() -> None:
    points = [(2.0, 5.0), (1.0, 9.0), (3.0, 5.0), (1.0, 8.0), (4.0, 1.0), (2.5, 6.0)]
    assert pareto_front(points) == [3, 0, 4]


def test_page_is_self_contained(plan_page) -> None:
    text = plan_page[0].read_text()
    assert not re.search(r"""(src|href|action)\s*=\s*["']?\s*(https?:)?//""", text, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?(https?:)?//|<link\b|<iframe\b", text, re.I)
    assert re.findall(r"https?://[^\s\"'<]+", text) == ["http://www.w3.org/2000/svg"]  # the SVG namespace only


def test_simulate_page_numbers_equal_json(tmp_path) -> None:
    page = tmp_path / "sim.html"
    out = run(*SIMULATE, "--report", str(page))
    assert f"report page: {page}" in out.replace("\n", "")
    data = embedded_data(page.read_text())
    assert data["result"] == json.loads(run(*SIMULATE, "--json"))
    (alt,) = data["alternatives"]
    assert alt["report"] == data["result"]
    assert len(alt["timelines"][0]["ops"]) == 2 * 32 * 2 * 2  # F and B of 32 micro-batches, 2 chunks, 2 devices


def test_plan_page_numbers_equal_json(plan_page) -> None:
    page, printed = plan_page
    data = embedded_data(page.read_text())
    assert data["result"] == printed
    alts = data["alternatives"]
    assert alts[0]["report"] == printed["report"] and alts[0]["plan"] == printed["plan"]
    labels = [a["label"] for a in alts]
    assert labels[:4] == ["chosen", "dp", "zero3", "megatron-grid"]
    for a in alts[1:4]:
        assert a["report"] == {k: v for k, v in printed["baselines"][a["label"]].items() if k != "strategy"}
    pareto = [a for a in alts if a["label"].startswith("pareto")]
    assert len(pareto) >= 3 and len(data["priced"]) > len(pareto)
    times = [a["report"]["iteration_time_s"] for a in pareto]
    memory = [a["report"]["peak_memory_gib"] for a in pareto]
    assert times == sorted(times) and memory == sorted(memory, reverse=True)


def test_report_command(tmp_path) -> None:
    saved = tmp_path / "plan.json"
    saved.write_text(run(*PLAN[:-1], "--json"))
    page = tmp_path / "saved.html"
    run("report", *PLAN[1:5], "--from", str(saved), "--out", str(page))
    data = embedded_data(page.read_text())
    assert data["result"] == json.loads(saved.read_text())
    assert data["alternatives"][0]["report"] == data["result"]["report"]
    page = tmp_path / "strategy.html"
    run("report", *SIMULATE[1:], "--out", str(page))
    assert embedded_data(page.read_text())["result"] == json.loads(run(*SIMULATE, "--json"))


def test_report_paths_checked_first(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    bad = str(tmp_path / "file" / "page.html")
    assert_bad_input(runner.invoke(app, [*SIMULATE, "--report", bad]), "--report")
    assert_bad_input(runner.invoke(app, [*PLAN, "--report", bad]), "--report")
    assert_bad_input(runner.invoke(app, ["report", *SIMULATE[1:], "--out", bad]), "--out")
    assert_bad_input(runner.invoke(app, ["report", *SIMULATE[1:5], "--from", str(tmp_path / "file")]), "--from")
    (tmp_path / "sim.json").write_text(run(*SIMULATE, "--json"))
    assert_bad_input(runner.invoke(app, ["report", *SIMULATE[1:5], "--from", str(tmp_path / "sim.json")]),
                     "holds no plan")


# --- in headless Chromium -------------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def chromium() -> str:
    """The chromium binary, installed with apt-get when absent (as root); skips where it cannot be."""
    found = shutil.which("chromium")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
            subprocess.run(cmd, env=env, capture_output=True, timeout=900, check=False)
        found = shutil.which("chromium")
    if found is None:
        pytest.skip("chromium is not installed and cannot be (apt-get install chromium needs root on Debian)")
    return found


def browse(chromium: str, page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """Run headless Chromium on `page` (console messages on stderr)."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr", "--v=0", *args,
           page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)


def probe(chromium: str, page: Path, tmp: Path, script: str) -> dict:
    """Load `page` in Chromium and run `script` (a function body) after the page's own scripts: what it
    returns. The page may raise no error and log no console message."""
    body = f"""<script>(() => {{
      const result = (() => {{ {script} }})();
      document.body.appendChild(Object.assign(document.createElement("pre"), {{id: "probe",
        textContent: JSON.stringify({{result, errors: window.__errors}})}}));
    }})();</script></body>"""
    probed = tmp / "probed.html"
    probed.write_text(page.read_text().replace("<head>", "<head>" + ERRORS, 1).replace("</body>", body, 1))
    done = browse(chromium, probed, tmp, "--dump-dom")
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout, re.S)
    assert found, done.stdout[-2000:] + done.stderr[-2000:]
    out = json.loads(html.unescape(found.group(1)))
    assert out["errors"] == []
    assert not [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return out["result"]


def test_page_in_chromium(chromium, plan_page, tmp_path) -> None:
    """Loads with no console errors, shows the `--json` numbers, and clicking an alternative (a point of the
    Pareto chart) updates the timeline and the memory view."""
    page, printed = plan_page
    alts = embedded_data(page.read_text())["alternatives"]
    pick = max(range(len(alts)), key=lambda i: len(alts[i]["timelines"][0]["ops"]))
    script = """
      const cards = () => Object.fromEntries([...document.querySelectorAll("#headline .card")]
        .map(c => [c.dataset.key, JSON.parse(c.dataset.value)]));
      const view = () => ({plan: document.getElementById("timeline").dataset.plan,
        ops: document.querySelectorAll("#timeline .ops rect").length,
        memory: document.querySelectorAll("#memory rect.mem").length, cards: cards()});
      const before = view();
      document.querySelector('#pareto .alt-point[data-index="PICK"]').dispatchEvent(new MouseEvent("click"));
      return {before, after: view()};""".replace("PICK", str(pick))
    result = probe(chromium, page, tmp_path, script)
    before, after = result["before"], result["after"]
    report = printed["report"]
    assert before["plan"] == "0" and before["cards"] == {k: report[k] for k in before["cards"]}
    assert len(before["cards"]) == 6
    assert before["ops"] == len(alts[0]["timelines"][0]["ops"])
    assert after["plan"] == str(pick) and after["ops"] == len(alts[pick]["timelines"][0]["ops"]) != before["ops"]
    assert after["cards"]["iteration_time_s"] == alts[pick]["report"]["iteration_time_s"]
    assert after["memory"] == 6 * len(alts[pick]["report"]["devices"])


def test_memory_below_the_device_in_chromium(chromium, tmp_path) -> None:
    """A plan paging states from host memory and NVMe (Llama-2 13B on one A100, `--host-memory`): the headline
    shows host memory and NVMe per node as the `--json` report has them."""
    page = tmp_path / "paged.html"
    printed = json.loads(run("plan", "--model", "llama2-13b", "--cluster", "1x1xA100-80GB", "--seq-len", "2048",
                             "--global-batch", "8", "--host-memory", "--json", "--report", str(page)))
    cards = probe(chromium, page, tmp_path, """return Object.fromEntries([...document.querySelectorAll(
      "#headline .card")].map(c => [c.dataset.key, [JSON.parse(c.dataset.value), c.textContent]]));""")
    report = printed["report"]
    assert report["host_memory_gib"] > 0 and report["nvme_gib"] > 0 and len(cards) == 8
    assert cards["host_memory_gib"] == [report["host_memory_gib"], "host memory per node" +
                                        f"{report['host_memory_gib']:.1f} of {report['host_capacity_gib']:.0f} GiB"]
    assert cards["nvme_gib"][0] == report["nvme_gib"] and cards["fits"] == [True, "fitsyes"]


@pytest.mark.parametrize("view", ["straggler", "varlen"])
def test_straggler_and_varlen_views(chromium, view, tmp_path) -> None:
    """`plan --slow` and `varlen` pages: their result equals `--json`, and their view renders in Chromium."""
    from importlib.resources import files

    lengths = str(files("plait") / "data" / "wikipedia-lengths-10k.txt")
    args = [*PLAN[:-1], "--slow", "2:5.0"] if view == "straggler" else \
        ["varlen", *PLAN[1:5], "--lengths", lengths, "--global-batch", "16", "--batches", "3"]
    page = tmp_path / "page.html"
    printed = json.loads(run(*args, "--json", "--report", str(page)))
    assert embedded_data(page.read_text())["result"] == printed
    shown = probe(chromium, page, tmp_path, f"""const s = document.getElementById("{view}-section");
      return {{hidden: s.hidden, bars: s.querySelectorAll("svg rect").length, rows: s.querySelectorAll("tr").length}};""")
    assert shown == {"hidden": False, "bars": 3, "rows": 1 + (3 if view == "varlen" else 5)}


def test_screenshot_not_blank(chromium, plan_page, tmp_path) -> None:
    from PIL import Image

    shot = tmp_path / "page.png"
    browse(chromium, plan_page[0], tmp_path, "--window-size=1280,1600", f"--screenshot={shot}")
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # text, charts and bars, not one flat colour
    assert max(n for n, _ in colors) < 0.9 * image.size[0] * image.size[1]
