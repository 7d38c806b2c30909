"""Every local path a spec names or implies stays under the operator's roots (TDEPLOY_ALLOWED_ROOTS, else the
current folder): outputs, the deployment folder, data inputs; `..` and symbolic links cannot leave them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.preflight import confinement_problems, preflight
from tasks.roots import ALLOWED_ROOTS_ENV
from tasks.spec import SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from tests.unit.checkpoints import no_key_and_quiet_dcp, tiny_model  # noqa: F401 - the fixture is autouse
from training.checkpoint import CheckpointManager
from training.config import CheckpointConfig
from training.storage import StorageConfig

PREPARED = {"data": {"dataset_url": None, "prepare": {"builtin_corpus": "python-docs", "tokenizer": {"kind": "bytes"}}}}


def _spec(overrides: dict[str, Any]) -> Any:
    """TINY_SPEC preparing its own data, every path derived from runs/tiny unless `overrides` names it."""
    paths = {"checkpoint": {"url": None}, "run": {"output_url": None}}
    return parse_spec(deep_merge(deep_merge(deep_merge(TINY_SPEC, PREPARED), paths), overrides))


def _refused(spec: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        preflight(spec)
    return caught.value.problems


@pytest.fixture
def allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmp_path/allowed: the operator's only root, and the current folder."""
    root = tmp_path / "allowed"
    root.mkdir()
    monkeypatch.chdir(root)
    monkeypatch.setenv(ALLOWED_ROOTS_ENV, str(root))
    return root


def test_a_deployment_dir_of_etc_is_refused_naming_the_field_the_roots_and_the_variable(allowed: Path) -> None:
    problems = _refused(_spec({"deployment_dir": "/etc"}))
    assert problems[0].startswith(f"deployment_dir=/etc: is /etc, outside the folders tdeploy may use on this machine, "
                                  f"{allowed} ({ALLOWED_ROOTS_ENV}); use a path under {allowed}")  # fmt: skip
    assert f"{ALLOWED_ROOTS_ENV}={allowed}{os.pathsep}/etc" in problems[0]
    assert problems == problems[:1]  # its output/, checkpoints/, datasets/ ... are not named again


def test_plan_does_not_write_plan_json_outside_the_roots(allowed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    spec = allowed / "spec.json"
    spec.write_text(json.dumps(deep_merge(deep_merge(TINY_SPEC, PREPARED), {"deployment_dir": str(outside)})))
    planned = CliRunner().invoke(app, ["plan", str(spec)], terminal_width=400)
    assert planned.exit_code == 0, planned.output  # the plan is printed
    assert f"plan.json not written: capacity.output_url={outside}: is {outside}, outside" in planned.output
    assert not outside.exists()
    checked = CliRunner().invoke(app, ["validate-spec", str(spec), "--check-paths"], terminal_width=400)
    assert checked.exit_code == 2 and f"deployment_dir={outside}: is {outside}, outside" in checked.output


def test_a_ledger_url_that_climbs_out_with_dot_dot_is_refused(allowed: Path) -> None:
    problems = _refused(_spec({"acceptance": {"ledger_url": "../../../../etc/passwd"}}))
    assert len(problems) == 1 and problems[0].startswith("acceptance.ledger_url=../../../../etc/passwd: is /")
    assert f"outside the folders tdeploy may use on this machine, {allowed}" in problems[0]


def test_a_symbolic_link_inside_the_root_that_leads_outside_is_refused(allowed: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "link").symlink_to(outside)
    problems = _refused(_spec({"checkpoint": {"url": "link/checkpoints"}}))
    assert problems == [problems[0]] and problems[0].startswith(
        f"checkpoint.url=link/checkpoints: leads to {outside / 'checkpoints'}, outside"
    )
    # A link planted in an output folder (the run appends to output/metrics.jsonl) is refused too.
    (allowed / "runs" / "tiny" / "output").mkdir(parents=True)
    (allowed / "runs" / "tiny" / "output" / "metrics.jsonl").symlink_to(outside / "crontab")
    problems = _refused(_spec({}))
    assert problems[0].startswith(f"run.output_url=runs/tiny/output: runs/tiny/output/metrics.jsonl in it leads "
                                  f"to {outside / 'crontab'}, outside")  # fmt: skip


def test_a_glob_of_sources_that_matches_a_link_leading_outside_is_refused(allowed: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not for a corpus")
    (allowed / "raw").mkdir()
    (allowed / "raw" / "a.txt").write_text("fine")
    (allowed / "raw" / "b.txt").symlink_to(secret)
    prepare = {"builtin_corpus": None, "sources": [{"url": "raw/*.txt", "format": "txt"}]}
    problems = _refused(_spec({"data": {"prepare": prepare}}))
    assert problems == [f"data.prepare.sources[0].url=raw/*.txt: raw/b.txt in it leads to {secret}, outside "
                        + problems[0].split(", outside ", 1)[1]]  # fmt: skip


def test_the_operator_allows_another_root_with_the_variable(
    allowed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shared = tmp_path / "shared"
    spec = _spec({"deployment_dir": str(shared / "runs" / "tiny")})
    assert confinement_problems(spec)[0].startswith(f"deployment_dir={shared / 'runs' / 'tiny'}: ")
    monkeypatch.setenv(ALLOWED_ROOTS_ENV, f"{allowed}{os.pathsep}{shared}")
    assert confinement_problems(spec) == []
    preflight(spec)


def test_a_relative_root_is_refused_naming_the_variable(allowed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ALLOWED_ROOTS_ENV, f"{allowed}{os.pathsep}shared")
    problems = _refused(_spec({}))
    assert problems[0].startswith(f"{ALLOWED_ROOTS_ENV}={allowed}{os.pathsep}shared: 'shared' is not an absolute")


def test_without_the_variable_relative_default_paths_in_the_current_folder_are_fine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ALLOWED_ROOTS_ENV)
    monkeypatch.chdir(tmp_path)
    preflight(_spec({}))  # runs/tiny/...
    monkeypatch.chdir(REPO)  # the README's main job, from the repository's root
    preflight(load_spec("examples/local.yaml"))
    problems = _refused(_spec({"deployment_dir": str(tmp_path / "elsewhere")}))
    assert f"outside the folders tdeploy may use on this machine, {REPO} (the current folder; " in problems[0]


def test_retention_removes_a_planted_step_link_without_touching_where_it_leads(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "rng").mkdir(parents=True)
    (outside / "rng" / "keep.json").write_text("{}")
    root = tmp_path / "ck"
    root.mkdir()
    (root / "step-00000001").symlink_to(outside)  # an unfinished 'checkpoint' older than the ones saved below
    model, optimizer = tiny_model()
    manager = CheckpointManager(CheckpointConfig(url=str(root), keep_last=1), StorageConfig())
    for step in (2, 3):
        manager.save(step, model, optimizer, {"step": step})
    assert manager.committed_steps() == [3]
    assert not (root / "step-00000001").exists() and (outside / "rng" / "keep.json").read_text() == "{}"


HOSTILE_PATHS = {"etc": "/etc/cron.d", "dot-dot": "../../../../../../../../etc/cron.d", "home": "~/.ssh",
                 "file-url": "file:///etc/cron.d"}  # fmt: skip
CONFINED_FIELDS = [
    "deployment_dir",
    "run.output_url",
    "checkpoint.url",
    "data.prepare.output_url",
    "data.prepare.tokenizer.path",
    "data.adopted_url",
    "capacity.output_url",
    "capacity.calibration_url",
    "acceptance.work_url",
    "acceptance.ledger_url",
    "image.storage_dir",
    "data.prepare.images.path",
]
# What a field needs beside it to be read at all: an image source replaces the text corpus.
FIELD_CONTEXT: dict[str, dict[str, Any]] = {
    "data.prepare.images.path": {"data": {"prepare": {"builtin_corpus": None,
                                                      "images": {"kind": "imagefolder", "image_size": 32}}}},
}  # fmt: skip


def _with(path: str, value: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    node = out
    *parents, leaf = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


@pytest.mark.parametrize("field", CONFINED_FIELDS)
@pytest.mark.parametrize("value", HOSTILE_PATHS.values(), ids=HOSTILE_PATHS.keys())
def test_train_refuses_a_hostile_path_in_every_confined_field_before_any_work(
    allowed: Path, monkeypatch: pytest.MonkeyPatch, field: str, value: str
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a path outside the roots got past train's pre-launch checks")

    monkeypatch.setattr("tasks.launch.local.run_local", refuse)
    monkeypatch.setattr("flows.cli.data.data_step", refuse)
    spec = allowed / "spec.json"
    overrides = deep_merge(FIELD_CONTEXT.get(field, {}), _with(field, value))
    spec.write_text(json.dumps(deep_merge(deep_merge(TINY_SPEC, PREPARED), overrides)))
    result = CliRunner().invoke(app, ["train", str(spec)], terminal_width=400)
    assert result.exit_code == 2, result.output
    assert f"  - {field}={value}: " in result.output and f"{allowed} ({ALLOWED_ROOTS_ENV})" in result.output
    assert "Traceback" not in result.output
