"""Preflight: every unusable path of a spec is refused up front, all at once, with the field, the value and the fix.

Tests run as root, for whom os.access() allows writing anywhere: the unwritable cases are paths under a
regular file (no user can create a folder there), not folders with restrictive modes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.preflight import preflight
from tasks.spec import SpecError, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from tests.processes import run_group


def _spec_data(tmp_path: Path, tiny_dataset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    (tmp_path / "afile").write_text("a regular file\n")
    paths = {
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(tmp_path / "ckpt")},
        "run": {"output_url": str(tmp_path / "out")},
    }
    return deep_merge(deep_merge(TINY_SPEC, paths), overrides)


def _prepare(**prepare: Any) -> dict[str, Any]:
    prepare = {"output_url": "{tmp}/datasets", "tokenizer": {"kind": "bytes"}, **prepare}
    return {"data": {"dataset_url": None, "prepare": prepare}}


# (field named in the error, overrides with {tmp} for the test's folder, words of the problem)
CASES = [
    ("run.output_url", {"run": {"output_url": "{tmp}/afile/out"}}, "is a file, not a folder"),
    ("checkpoint.url", {"checkpoint": {"url": "{tmp}/afile"}}, "is a file, not a folder"),
    ("data.dataset_url", {"data": {"dataset_url": "{tmp}/no-such-dataset"}}, "does not exist"),
    ("data.prepare.output_url", _prepare(output_url="{tmp}/afile/datasets", sources=["{tmp}/afile"]), "is a file"),
    ("data.prepare.sources[0].url", _prepare(sources=["{tmp}/raw/*.txt"]), "the glob matches no file"),
    ("data.prepare.sources[1].url", _prepare(sources=["{tmp}/afile", {"url": "{tmp}/x.jsonl"}]), "does not exist"),
    (
        "data.prepare.tokenizer.path",
        _prepare(sources=["{tmp}/afile"], tokenizer={"kind": "bpe", "path": "{tmp}/tok.json"}),
        "exist",
    ),
    ("data.tokenizer_url", {"data": {"tokenizer_url": "{tmp}/no-tokenizer.json"}}, "does not exist"),
    ("capacity.output_url", {"capacity": {"output_url": "{tmp}/afile/plans"}}, "afile is a file"),
    ("acceptance.work_url", {"acceptance": {"work_url": "{tmp}/afile/acceptance"}}, "is a file, not a folder"),
    ("nodes.ssh_key_path", {"nodes": {"ssh_key_path": "{tmp}/no-key"}}, "does not exist"),
]


def _fill(value: Any, tmp: Path) -> Any:
    if isinstance(value, str):
        return value.replace("{tmp}", str(tmp))
    if isinstance(value, dict):
        return {k: _fill(v, tmp) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill(v, tmp) for v in value]
    return value


@pytest.mark.parametrize(("field", "overrides", "words"), CASES, ids=[c[0] for c in CASES])
def test_an_unusable_path_is_refused_by_validate_spec_with_its_field_value_and_fix(
    tmp_path: Path, tiny_dataset: str, field: str, overrides: dict[str, Any], words: str
) -> None:
    data = _spec_data(tmp_path, tiny_dataset, _fill(overrides, tmp_path))
    with pytest.raises(SpecError) as err:
        preflight(parse_spec(data))
    line = next((p for p in err.value.problems if p.startswith(f"{field}=")), None)
    assert line is not None, err.value.problems
    assert words in line and ";" in line, line

    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    out = CliRunner().invoke(app, ["validate-spec", str(spec_file), "--check-paths"])
    assert out.exit_code == 2, out.output
    assert f"{field}=" in out.output and "ok" not in out.output.split()


def test_every_problem_is_reported_at_once(tmp_path: Path, tiny_dataset: str) -> None:
    overrides = {
        "run": {"output_url": "{tmp}/afile/out"},
        "checkpoint": {"url": "{tmp}/afile/ckpt"},
        "data": {"dataset_url": "{tmp}/missing"},
    }
    with pytest.raises(SpecError) as err:
        preflight(parse_spec(_spec_data(tmp_path, tiny_dataset, _fill(overrides, tmp_path))))
    fields = [p.split("=", 1)[0] for p in err.value.problems]
    assert fields == ["run.output_url", "checkpoint.url", "data.dataset_url"], err.value.problems


def test_a_folder_that_does_not_exist_yet_passes_and_nothing_is_created(tmp_path: Path, tiny_dataset: str) -> None:
    data = _spec_data(tmp_path, tiny_dataset, {"run": {"output_url": str(tmp_path / "new" / "deep" / "out")}})
    before = sorted(tmp_path.rglob("*"))
    preflight(parse_spec(data))
    assert sorted(tmp_path.rglob("*")) == before
    data["run"]["output_url"] = str(tmp_path / "afile" / "deep" / "out")
    with pytest.raises(SpecError, match=r"run.output_url=.*afile is a file, not a folder"):
        preflight(parse_spec(data))


def test_a_plain_string_source_is_taken_as_its_url(tmp_path: Path, tiny_dataset: str) -> None:
    data = _spec_data(tmp_path, tiny_dataset, _fill(_prepare(sources=["{tmp}/afile"]), tmp_path))
    spec = parse_spec(data)
    assert spec.data.prepare is not None and spec.data.prepare.sources[0].url == str(tmp_path / "afile")
    preflight(spec)
    data["data"]["prepare"]["sources"] = [3]
    with pytest.raises(SpecError) as err:
        parse_spec(data)
    assert "data.prepare.sources.0=3" in str(err.value) and "`- data/*.txt`" in str(err.value)


def test_train_refuses_an_unwritable_checkpoint_url_before_any_training(tmp_path: Path, tiny_dataset: str) -> None:
    data = _spec_data(tmp_path, tiny_dataset, _fill({"checkpoint": {"url": "{tmp}/afile/ckpt"}}, tmp_path))
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(data))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", "from flows.cli import main; main()", "train", str(spec_file)]
    proc = run_group(cmd, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"checkpoint.url={tmp_path}/afile/ckpt" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "runs").exists()
