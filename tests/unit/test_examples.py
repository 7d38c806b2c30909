"""Every example spec validates and plans, with its shared-storage and object-store paths mapped into tmp_path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.capacity.record import read_plan
from tests.conftest import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
# Inputs a spec reads: preflight requires them to exist, so the test creates them where it maps them.
INPUTS = (("data", "dataset_url"),)
INPUT_FILES = (("nodes", "ssh_key_path"), ("nodes", "known_hosts_path"))


def _remap(value: Any, root: Path) -> Any:
    """The spec with every absolute path and object-store URL moved under `root`; the repository's own files an
    example reads (examples/models/...: relative to the repository root, where the README runs them) made
    absolute; other relative paths stay."""
    if isinstance(value, dict):
        return {key: _remap(item, root) for key, item in value.items()}
    if isinstance(value, list):
        return [_remap(item, root) for item in value]
    if isinstance(value, str) and value.startswith("s3://"):
        return str(root / "s3" / value.removeprefix("s3://"))
    if isinstance(value, str) and value.startswith("/"):
        return str(root / value.lstrip("/"))
    if isinstance(value, str) and value.startswith("examples/"):
        return str(REPO / value)
    return value


def _mapped(example: Path, tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """The example rewritten into tmp_path, its inputs created; returns the new file and its data."""
    data = _remap(yaml.safe_load(example.read_text()), tmp_path / "mapped")
    for section, field in INPUTS:
        if data.get(section, {}).get(field):
            Path(data[section][field]).mkdir(parents=True)
    for section, field in INPUT_FILES:
        if data.get(section, {}).get(field):
            Path(data[section][field]).parent.mkdir(parents=True, exist_ok=True)
            Path(data[section][field]).touch()
    path = tmp_path / example.name
    path.write_text(yaml.safe_dump(data))
    return path, data


def test_there_is_an_example_for_every_scheduler_and_a_large_model_plan() -> None:
    names = {path.name for path in EXAMPLES}
    assert {"local.yaml", "local-multinode.yaml", "multihost.yaml", "slurm.yaml", "kubernetes.yaml",
            "plan-70b.yaml"} <= names  # fmt: skip
    schedulers = {yaml.safe_load(path.read_text())["cluster"]["scheduler"] for path in EXAMPLES}
    assert schedulers == {"local", "ssh", "slurm", "kubernetes"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[path.stem for path in EXAMPLES])
def test_example_validates_and_its_plan_runs(example: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # relative paths (runs/<name>) land in tmp_path
    spec, data = _mapped(example, tmp_path)
    validated = CliRunner().invoke(app, ["validate-spec", str(spec)])
    assert validated.exit_code == 0, validated.output
    assert validated.output.startswith("ok") and data["name"] in validated.output
    planned = CliRunner().invoke(app, ["plan", str(spec), "--out", str(tmp_path / "plan")], terminal_width=200)
    assert planned.exit_code == 0, planned.output
    assert read_plan(str(tmp_path / "plan" / "plan.json")).fits is True


def test_the_70b_plan_fits_on_64_h100s_with_its_tensor_parallel_layout(tmp_path: Path) -> None:
    spec, _ = _mapped(REPO / "examples" / "plan-70b.yaml", tmp_path)
    planned = CliRunner().invoke(app, ["plan", str(spec), "--json", "--out", str(tmp_path / "plan")])
    assert planned.exit_code == 0, planned.output
    plan = read_plan(str(tmp_path / "plan" / "plan.json"))
    layout = plan.requested.layout
    assert plan.fits is True and layout["world"] == 64 and layout["tp"] == 8 and layout["zero"] == 3
    assert plan.requested.peak_bytes <= plan.requested.usable_bytes
