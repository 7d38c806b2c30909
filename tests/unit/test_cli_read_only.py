"""The read-only and planning commands load only what they use: no torch, Prefect or Great Expectations for the
example specs; and `tdeploy export` finds its dataset without validating it again."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.launch.base import JobHandle
from tasks.prepare import step as data_step
from tasks.prepare.step import DataInputs, PrepareConfig
from tasks.spec import load_spec
from tests.processes import run_group

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "prefect", "great_expectations")
EXAMPLES = sorted(str(path.relative_to(REPO)) for path in (REPO / "examples").glob("*.yaml"))

# Each command run in one fresh interpreter, in order; after each, the heavy modules loaded so far.
_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])  # this checkout, whatever the folder the commands run in
from flows.cli import app
loaded = {}
for args in json.loads(sys.argv[1]):
    try:
        app(args, prog_name="tdeploy")
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    loaded[" ".join(args)] = {"exit": code, "heavy": [name for name in %r if name in sys.modules]}
print(json.dumps(loaded))
"""


def _loaded_by(commands: list[list[str]], cwd: Path) -> dict[str, dict[str, object]]:
    proc = run_group([sys.executable, "-c", _SCRIPT % (HEAVY,), json.dumps(commands), str(REPO)], timeout=120, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_validate_spec_of_every_example_loads_no_torch_prefect_or_great_expectations() -> None:
    assert len(EXAMPLES) >= 10
    loaded = _loaded_by([["validate-spec", spec] for spec in EXAMPLES], REPO)
    assert {args: seen["exit"] for args, seen in loaded.items() if seen["exit"] != 0} == {}
    assert {args: seen["heavy"] for args, seen in loaded.items() if seen["heavy"]} == {}


def test_plan_render_schema_history_baseline_status_and_diagnose_load_none_of_them(tmp_path: Path) -> None:
    shutil.copy(REPO / "examples" / "local.yaml", tmp_path / "local.yaml")  # its runs/ go under tmp_path
    job = tmp_path / "job"
    job.mkdir()
    dead_agent = {"pid": 2**22 + 1, "start_time": 1}  # above pid_max's default: never a live process
    handle = JobHandle("local", "x1", "tiny", str(job), str(job / "train.log"), details={"agents": [dead_agent]})
    (job / "job.json").write_text(json.dumps(handle.to_json()))
    (job / "exit-0.txt").write_text("0\n")
    (job / "train.log").write_text("step 1 loss 7.6\n")
    commands = [
        ["plan", "local.yaml", "--out", str(tmp_path / "plan")],
        ["render", "local.yaml", "--out", str(tmp_path / "rendered")],
        ["schema", "--out", str(tmp_path / "spec.schema.json")],
        ["history", "local.yaml"],
        ["baseline", "local.yaml"],
        ["status", str(job)],
        ["diagnose", str(job), "--spec", "local.yaml"],
    ]
    loaded = _loaded_by(commands, tmp_path)
    assert list(loaded) == [" ".join(args) for args in commands]
    assert {args: seen["exit"] for args, seen in loaded.items() if seen["exit"] != 0} == {}
    assert {args: seen["heavy"] for args, seen in loaded.items() if seen["heavy"]} == {}
    assert (tmp_path / "plan" / "plan.json").is_file() and (tmp_path / "spec.schema.json").is_file()


def test_the_data_step_of_an_export_finds_the_prepared_dataset_without_validating_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[bool] = []

    def prepare(cfg: PrepareConfig, storage: object, progress: object = None, validate: bool = True) -> object:
        calls.append(validate)
        raise RuntimeError("stop")  # the inputs were all this test wanted

    monkeypatch.setattr(data_step, "prepare_dataset", prepare)
    spec = load_spec(str(REPO / "examples" / "local.yaml"))
    for validate_data in (True, False):
        with pytest.raises(RuntimeError, match="stop"):
            data_step.run(DataInputs.of(spec, validate_data))
    assert calls == [True, False]


def test_tdeploy_export_asks_for_the_dataset_without_its_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    import flows.cli.serve

    asked: list[bool] = []

    def training_config(parsed: object, validate_data: bool = True) -> object:
        asked.append(validate_data)
        raise RuntimeError("stop")

    monkeypatch.setattr(flows.cli.serve, "training_config_prepared", training_config)
    result = CliRunner().invoke(app, ["export", str(REPO / "examples" / "local.yaml")])
    assert isinstance(result.exception, RuntimeError), result.output
    assert asked == [False]
