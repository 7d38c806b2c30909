"""The command line itself: --version, an example in every help, one name for output folders, a light --help,
and the plan's tables."""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import typer
from rich.console import Console
from rich.table import Table
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.accept import accept_inputs
from tasks.acceptance.mode import Mode
from tasks.acceptance.suite import AcceptanceInputs
from tasks.capacity.plan import CapacityPlan, plan_capacity
from tasks.capacity.report import rich_report
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
COMMANDS = typer.main.get_command(app).commands
HEAVY = ("torch", "prefect", "great_expectations", "ansible_runner", "fsspec", "tasks.spec")  # typer loads pydantic

# A model whose layouts fit or not depending on how they shard it (about 2.4 GiB per GPU under plain DDP).
SMALL_GPU = {
    "kind": "gpu", "memory_gib": 2, "peak_tflops_bf16": 100, "peak_tflops_fp16": 100, "peak_tflops_fp32": 10,
    "hbm_tb_s": 1, "intra_node_gb_s": 100, "inter_node_gb_s": 10,
}  # fmt: skip
BIG = {
    "cluster": {"procs_per_node": 8, "accelerator": "small-gpu"},
    "model": {"n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "vocab_size": 32000},
    "parallel": {"micro_batch": 8},
    "precision": {"dtype": "bf16"},
    "capacity": {"accelerators": {"small-gpu": SMALL_GPU}},
    "data": {"dataset_url": "/d"},
    "checkpoint": {"url": "/c"},
    "run": {"output_url": "/o"},
}


def test_version_prints_the_installed_distribution_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"tdeploy {importlib.metadata.version('transformer-deploy')}\n"


def test_every_commands_help_shows_an_example_that_parses() -> None:
    assert len(COMMANDS) >= 13
    for name, command in COMMANDS.items():
        result = CliRunner().invoke(app, [name, "--help"], terminal_width=200)
        assert result.exit_code == 0, (name, result.output)
        assert "Example" in result.output and f"tdeploy {name} " in result.output, (name, result.output)
        examples = [line.strip() for line in (command.epilog or "").splitlines() if line.strip().startswith("tdeploy")]
        assert examples, name
        for example in examples:
            prog, used, *args = shlex.split(example)
            assert (prog, used) == ("tdeploy", name), example
            command.make_context(name, args)  # raises on an option or argument the command does not take


def test_every_command_that_writes_files_takes_its_folder_as_out() -> None:
    for name in ("plan", "check-nodes", "build-image", "accept", "drill"):
        options = {opt for param in COMMANDS[name].params for opt in param.opts}
        assert "--out" in options and not options & {"--report", "--record-dir"}, (name, options)


def test_help_and_version_load_neither_torch_nor_prefect_nor_the_spec_model() -> None:
    script = f"""
import json, sys
loaded = {{}}
from flows.cli import app
loaded["import flows.cli"] = [name for name in {HEAVY!r} if name in sys.modules]
for args in [["--help"], ["--version"]] + [[name, "--help"] for name in {sorted(COMMANDS)!r}]:
    try:
        app(args, prog_name="tdeploy")
    except SystemExit:
        pass
    loaded[" ".join(args)] = [name for name in {HEAVY!r} if name in sys.modules]
print(json.dumps(loaded))
"""
    proc = run_group([sys.executable, "-c", script], timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert len(loaded) == len(COMMANDS) + 3
    assert {step: heavy for step, heavy in loaded.items() if heavy} == {}


def _plan() -> CapacityPlan:
    spec = parse_spec(deep_merge(TINY_SPEC, BIG))
    return plan_capacity(spec.name, spec.capacity, spec.cluster, spec.model, spec.parallel, spec.precision, spec.run)


def _rows(table: Table) -> list[list[str]]:
    """The body rows of a rendered table, cell by cell."""
    console = Console(width=1000, record=True, file=io.StringIO())
    console.print(table)
    lines = console.export_text().splitlines()
    body = lines[lines.index(next(line for line in lines if line.startswith("┡"))) + 1 : -1]
    return [[cell.strip() for cell in line.strip("│").split("│")] for line in body]


def _tables(plan: CapacityPlan) -> dict[str, Table]:
    return {str(part.title): part for part in rich_report(plan).renderables if isinstance(part, Table)}


def test_layouts_that_fit_table_lists_only_layouts_that_fit_and_the_misses_apart() -> None:
    plan = _plan()
    assert plan.search.fitting and plan.search.rejected, "the model must fit in some layouts and not in others"
    tables = _tables(plan)
    fitting = [row[0] for row in _rows(tables["layouts that fit, fastest first"])]
    assert fitting == [ev.layout.describe() for ev in plan.search.fitting]
    misses = [row[0] for row in _rows(tables["nearest layouts that do not fit"])]
    assert misses and set(misses) <= {ev.layout.describe() for ev in plan.search.rejected}
    assert not set(misses) & set(fitting)


def test_plan_tables_format_gib_with_two_decimals_and_seconds_to_three_significant_digits() -> None:
    gib = re.compile(r"^\d{1,3}(,\d{3})*\.\d{2}$")
    tables = _tables(_plan())
    memory = _rows(tables["memory of the requested layout"])
    assert len(memory) >= 8 and all(gib.match(value) for _, value in memory), memory
    layouts = _rows(tables["layouts that fit, fastest first"])
    for layout, gib_cell, step_s, mfu, _ in layouts:
        assert gib.match(gib_cell), (layout, gib_cell)
        digits = step_s.replace(",", "").replace(".", "").lstrip("0")
        assert "e" not in step_s and len(digits) == 3, (layout, step_s)
        assert re.fullmatch(r"\d{1,3}\.\d%", mfu), (layout, mfu)
    assert all(gib.match(row[1]) for row in _rows(tables["nearest layouts that do not fit"]))


def test_accept_passes_its_mode_and_its_drills_choice_by_name(tmp_path: Path) -> None:
    """`tdeploy accept`'s options reach the acceptance inputs as the mode and the drills choice, not positions."""
    parsed = parse_spec(deep_merge(TINY_SPEC, {"data": {"dataset_url": "/d"}, "checkpoint": {"url": "/c"},
                                               "run": {"output_url": "/o"}}))  # fmt: skip
    command = COMMANDS["accept"]

    def inputs(*args: str) -> AcceptanceInputs:
        params = command.make_context("accept", ["spec.yaml", *args]).params
        return accept_inputs(parsed, parsed.training_config(), params["mode"], params["drills"], params["image"],
                             params["out"])  # fmt: skip

    soak = inputs("--mode", "soak", "--drills", "--out", str(tmp_path))
    assert (soak.mode, soak.with_drills, soak.drills) == (Mode.SOAK, True, parsed.drills)
    assert soak.acceptance.work_url == str(tmp_path) and soak.record
    full = inputs()
    assert (full.mode, full.with_drills, full.acceptance) == (Mode.FULL, False, parsed.acceptance)
    with pytest.raises(typer.BadParameter, match="'canary' is not one of 'full', 'soak'"):
        inputs("--mode", "canary")  # a canary is tdeploy rollout's: it runs on acceptance.canary.nodes
