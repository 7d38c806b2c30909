"""Every path of a deployment comes from its spec through tasks/paths.py; the diagnosis reads the plan where the
spec puts it instead of looking in the folders above a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.capacity.plan import write_plan
from tasks.capacity.step import CapacityInputs
from tasks.paths import DeploymentPaths
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge


BASE = deep_merge(
    TINY_SPEC,
    {
        "deployment_dir": "/d/tiny",
        "data": {"dataset_url": "/ds"},
        "run": {"output_url": None},  # the deployment's own folders
        "checkpoint": {"url": None},
    },
)


def test_each_report_goes_where_the_spec_says_and_an_override_moves_only_its_own() -> None:
    spec = parse_spec(BASE)
    paths = DeploymentPaths.of(spec)
    assert paths.plan_url() == "/d/tiny/plan.json" and paths.node_report() == "/d/tiny/node-check.json"
    assert (paths.image_dir(), paths.serving_dir()) == ("/d/tiny/image", "/d/tiny/serving")
    assert paths.export_dir == "/d/tiny/export"
    assert paths.ledger_url == "/d/tiny/acceptance/ledger" and paths.workspace_base(nightly=True) == Path(
        "/d/tiny/acceptance/nightly"
    )
    assert (spec.run.output_url, spec.checkpoint.url) == ("/d/tiny/output", "/d/tiny/checkpoints")

    moved = parse_spec(deep_merge(BASE, {"capacity": {"output_url": "/plans"}}))
    assert DeploymentPaths.of(moved).plan_url() == "/plans/plan.json"
    assert DeploymentPaths.of(moved).node_report() == "/d/tiny/node-check.json"
    assert DeploymentPaths.of(moved).plan_url("/elsewhere") == "/elsewhere/plan.json"


def test_tdeploy_diagnose_reads_the_plan_of_the_spec_it_is_given_and_no_plan_found_by_walking_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds").mkdir()
    data = deep_merge(
        TINY_SPEC,
        {
            "deployment_dir": str(tmp_path / "deploy"),
            "data": {"dataset_url": str(tmp_path / "ds")},
            "checkpoint": {"url": str(tmp_path / "deploy" / "checkpoints")},
            "run": {"output_url": str(tmp_path / "deploy" / "output")},
            "capacity": {"accelerators": {"cpu": {"memory_gib": 0.0001}}, "enforce": False},
        },
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    spec = parse_spec(data)
    plan = CapacityInputs.of(spec).estimate()
    assert not plan.fits
    written = write_plan(plan, str(tmp_path / "deploy"))
    assert written == DeploymentPaths.of(spec).plan_url()
    run_dir = tmp_path / "deploy" / "output"
    run_dir.mkdir(parents=True)
    (run_dir / "train.log").write_text("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")

    with_spec = CliRunner().invoke(app, ["diagnose", str(run_dir), "--spec", str(spec_file)], terminal_width=400)
    assert with_spec.exit_code == 1, with_spec.output
    assert "capacity plan: " in with_spec.output and "GiB usable" in with_spec.output

    alone = CliRunner().invoke(app, ["diagnose", str(run_dir)], terminal_width=400)
    assert alone.exit_code == 1, alone.output
    assert "capacity plan: " not in alone.output  # plan.json sits in the folder above: not looked for there
