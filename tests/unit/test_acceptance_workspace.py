"""Acceptance run workspaces: a fresh folder per run, ids that sort by time, pruning, the latest pointer."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.suite import work_dir, workspace_root
from tasks.acceptance.workspace import (
    LATEST,
    LATEST_LINK,
    Workspace,
    latest_run,
    mark_latest,
    open_workspace,
    prune_workspaces,
    run_workspaces,
)
from tasks.run_id import RUN_ID, new_run_id
from tasks.spec import load_spec
from tests.conftest import REPO


def test_run_ids_are_unique_and_sort_in_the_order_they_were_made() -> None:
    ids = [new_run_id() for _ in range(500)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(RUN_ID.match(i) for i in ids)


def test_run_ids_made_at_the_same_instant_still_sort_in_order() -> None:
    instant = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    ids = [new_run_id(instant) for _ in range(20)]
    assert ids == sorted(ids) and len(set(ids)) == 20


def test_each_workspace_root_is_a_new_folder_under_the_specs_acceptance_folder(tmp_path: Path) -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    train = spec.training_config("unused-dataset")
    first, second = workspace_root(spec.acceptance, train), workspace_root(spec.acceptance, train)
    assert first != second
    base = (Path.cwd() / "runs" / "local" / "acceptance").resolve()
    assert Path(first).parent == base == Path(second).parent
    assert Path(workspace_root(spec.acceptance, train, nightly=True)).parent == base / "nightly"


def test_a_standalone_acceptance_config_puts_workspaces_beside_the_run_output(tmp_path: Path) -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    train = spec.training_config("unused-dataset").model_copy(
        update={"run": spec.run.model_copy(update={"output_url": str(tmp_path / "job" / "output")})}
    )
    root = work_dir(AcceptanceConfig(), train)
    assert root.parent == tmp_path / "job" / "acceptance" and root.is_dir() and (root / "drills").is_dir()


def _workspaces(base: Path, n: int) -> list[Path]:
    roots = []
    for _ in range(n):
        root = base / new_run_id()
        (root / "distributed").mkdir(parents=True)
        roots.append(root)
    return roots


def test_pruning_keeps_the_newest_runs_and_never_the_current_one(tmp_path: Path) -> None:
    old = _workspaces(tmp_path, 5)
    (tmp_path / "notes").mkdir()  # not a run workspace: never touched
    removed = prune_workspaces(tmp_path, 3, old[0])  # the oldest is the one in use
    assert removed == old[1:3]
    assert run_workspaces(tmp_path) == [old[0], old[3], old[4]]
    assert (tmp_path / "notes").is_dir()


def test_pruning_never_removes_the_latest_finished_run(tmp_path: Path) -> None:
    finished, *unfinished = _workspaces(tmp_path, 4)
    mark_latest(Workspace.at(finished))
    current = tmp_path / new_run_id()
    current.mkdir()
    prune_workspaces(tmp_path, 2, current)
    assert run_workspaces(tmp_path) == [finished, current]


def test_opening_a_workspace_starts_it_empty_and_prunes_the_older_ones(tmp_path: Path) -> None:
    old = _workspaces(tmp_path, 3)
    workspace = open_workspace(tmp_path / new_run_id(), keep=2)
    assert run_workspaces(tmp_path) == [old[-1], workspace.root]
    assert list(workspace.root.iterdir()) == [workspace.drills]
    (workspace.root / "distributed").mkdir()  # a retried step starts over: no earlier attempt's checkpoints
    again = open_workspace(workspace.root, keep=2)
    assert list(again.root.iterdir()) == [workspace.drills]


def test_the_drills_step_keeps_the_acceptance_reports_of_its_workspace(tmp_path: Path) -> None:
    workspace = open_workspace(tmp_path / new_run_id(), keep=3)
    (workspace.root / "acceptance.json").write_text("{}")
    (workspace.drills / "drill-base").mkdir(parents=True)
    open_workspace(workspace.root, keep=3, part="drills")
    assert (workspace.root / "acceptance.json").exists() and list(workspace.drills.iterdir()) == []


def test_the_latest_pointer_names_a_run_only_once_its_reports_are_written(tmp_path: Path) -> None:
    first = open_workspace(tmp_path / new_run_id(), keep=3)
    assert latest_run(tmp_path) is None and not (tmp_path / LATEST).exists()
    mark_latest(first)
    second = open_workspace(tmp_path / new_run_id(), keep=3)  # started, not finished
    assert latest_run(tmp_path) == first.root
    assert (tmp_path / LATEST_LINK).resolve() == first.root.resolve()
    mark_latest(second)
    assert latest_run(tmp_path) == second.root
    assert json.loads((tmp_path / LATEST).read_text())["root"] == str(second.root)
    assert (tmp_path / LATEST_LINK).resolve() == second.root.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.run_id, second.run_id, LATEST, LATEST_LINK])


def test_a_folder_that_is_not_a_run_workspace_is_refused_with_the_expected_form(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"not-a-run: not a run workspace \(its name must be a run id such as"):
        Workspace.at(tmp_path / "not-a-run")
