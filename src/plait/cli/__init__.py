"""The `plait` command: list presets, simulate and search plans, profile this machine, train.

One module per command; `common` holds what they share (the typer app, one-line errors, options, the
`main` entry point) and `tables` the tables that several of them print. Importing this package registers
every command, in the order `plait --help` lists them; heavy modules (torch, the planner, the report page)
are imported only inside the commands that need them.
"""

from __future__ import annotations

from plait.cli.common import (MAX_GLOBAL_BATCH, MAX_MEMORY_GIB, app, draw_picture, err, fail, load_calibration,
                              load_inputs, main, out, parse_slow, plan_of, read_plan)
from plait.cli.presets import clusters, models
from plait.cli.simulate import simulate_cmd, simulate_result
from plait.cli.report import report_cmd
from plait.cli.plan import plan_cmd
from plait.cli.varlen import varlen_cmd
from plait.cli.multitask import multitask_cmd
from plait.cli.kv_eval import kv_eval_cmd, print_kv_rows
from plait.cli.profile import print_profile, profile_cmd
from plait.cli.train import train_cmd
from plait.cli.tables import print_plan, print_report, ranks_text
from plait.io import json_line

__all__ = ["MAX_GLOBAL_BATCH", "MAX_MEMORY_GIB", "app", "clusters", "draw_picture", "err", "fail", "json_line",
           "kv_eval_cmd", "load_calibration", "load_inputs", "main", "models", "multitask_cmd", "out",
           "parse_slow", "plan_cmd", "plan_of", "print_kv_rows", "print_plan", "print_profile", "print_report",
           "profile_cmd", "ranks_text", "read_plan", "report_cmd", "simulate_cmd", "simulate_result", "train_cmd",
           "varlen_cmd"]
