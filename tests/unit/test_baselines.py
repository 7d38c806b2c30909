"""The baseline registry: what the key covers, untrusted files refused by name, never overwritten, never pruned."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from tasks.acceptance import suite
from tasks.acceptance.baselines import (
    Baseline,
    BaselineError,
    BaselineRegistry,
    baseline_key,
    curve_identity,
    judge_quality,
    registry_for,
)
from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillResult
from tasks.acceptance.workspace import (
    RunOutcome,
    latest_run,
    mark_latest,
    open_workspace,
    run_workspaces,
)
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.paths import BASELINES_DIR, DeploymentPaths
from tasks.run_id import new_run_id
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import TrainConfig
from training.dataset import DatasetWriter, TokenizerInfo, read_manifest
from training.run_output import RunOutputWriter, RunResult, StepRecord
from training.storage import StorageConfig
from validation.acceptance import DimensionResult


def _dataset(url: Path, last_token: int = 7) -> str:
    with DatasetWriter(str(url), 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=500) as writer:
        for i in range(20):
            writer.add_document("train", [(i * 13 + j) % 256 for j in range(60)] + [last_token])
        writer.add_document("val", list(range(100)))
    return str(url)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _dataset(tmp_path_factory.mktemp("data") / "ds")


def _train(root: Path, dataset: str, overrides: dict[str, Any] | None = None, name: str = "tiny") -> TrainConfig:
    paths = {
        "name": name,
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"output_url": str(root / "output")},
    }
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), overrides or {})).training_config()


def _key(train: TrainConfig, world_size: int = 2) -> str:
    return baseline_key(curve_identity(train, world_size, read_manifest(train.data.dataset_url)))


def test_the_key_stays_when_paths_names_cadences_and_the_datasets_location_change(tmp_path: Path, dataset: str) -> None:
    moved = shutil.copytree(dataset, tmp_path / "elsewhere" / "ds")
    first = _key(_train(tmp_path / "a", dataset))
    other = _train(
        tmp_path / "b",
        str(moved),
        {
            "checkpoint": {"save_every_steps": 3, "keep_last": 7},
            "run": {"log_every_steps": 1, "eval_every_steps": 5, "threads_per_rank": 2, "metrics_port": 9400},
            "acceptance": {"thresholds": {"quality_max_rel_worse": 0.5}, "keep_runs": 9},
        },
        name="renamed",
    )
    assert _key(other) == first


@pytest.mark.parametrize(
    "change",
    [
        {"run": {"seed": 8}},
        {"optim": {"lr_peak": 1e-3}},
        {"model": {"d_model": 64}},
        {"model": {"n_layers": 3}},
        {"run": {"steps": 21}},
        {"parallel": {"grad_accum_steps": 2}},
        {"parallel": {"micro_batch": 2}},
        {"precision": {"dtype": "bf16"}},
    ],
    ids=lambda c: ".".join([next(iter(c)), next(iter(next(iter(c.values()))))]),
)
def test_the_key_changes_with_anything_that_changes_the_curve(
    tmp_path: Path, dataset: str, change: dict[str, Any]
) -> None:
    assert _key(_train(tmp_path, dataset, change)) != _key(_train(tmp_path, dataset))


def test_the_key_changes_with_the_world_size_and_the_datasets_content(tmp_path: Path, dataset: str) -> None:
    train = _train(tmp_path, dataset)
    assert _key(train, world_size=4) != _key(train)
    changed = _train(tmp_path, _dataset(tmp_path / "other", last_token=8))
    assert _key(changed) != _key(train)


def _baseline(key: str = "a" * 64, val_loss: float = 3.0, run_id: str = "first") -> Baseline:
    return Baseline(
        key=key, created_at="2030-01-01T00:00:00+00:00", deployment_dir="/runs/tiny", run_id=run_id, workspace="/w",
        output_dir="/w/distributed/output", identity={"k": 1}, curve={1: 5.5, 2: 4.0}, val_loss=val_loss,
        first_loss=5.5,
    )  # fmt: skip


def test_a_recorded_baseline_is_read_back_and_never_overwritten(tmp_path: Path) -> None:
    registry = BaselineRegistry(tmp_path / BASELINES_DIR)
    assert registry.load("a" * 64) is None
    assert registry.record(_baseline()) is True
    assert registry.record(_baseline(val_loss=1.0, run_id="second")) is False
    loaded = registry.load("a" * 64)
    assert (
        loaded is not None and loaded.run_id == "first" and loaded.val_loss == 3.0 and loaded.curve == {1: 5.5, 2: 4.0}
    )
    assert sorted(p.name for p in registry.folder.iterdir()) == [f"{'a' * 64}.json"]  # no temporary files left


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not a valid baseline"),
        (json.dumps({"key": "a" * 64}), "not a valid baseline"),
        (lambda b: {**b, "val_loss": "low"}, "val_loss"),
        (lambda b: {**b, "curve": {"one": 5.5}}, "curve"),
        (lambda b: {**b, "extra": 1}, "extra"),
        (lambda b: {**b, "key": "b" * 64}, "not its file name's"),
        (lambda b: {**b, "curve": {}}, "empty curve"),
        (lambda b: {**b, "format_version": 99}, "format_version=99"),
    ],
    ids=["not-json", "fields-missing", "wrong-type", "step-not-int", "unknown-field", "other-key", "empty", "newer"],
)
def test_a_malformed_baseline_file_is_refused_with_its_name_and_the_fix(
    tmp_path: Path, content: Any, problem: str
) -> None:
    registry = BaselineRegistry(tmp_path)
    if callable(content):
        content = json.dumps(content(json.loads(_baseline().model_dump_json())))
    registry.path("a" * 64).write_text(content)
    with pytest.raises(BaselineError) as caught:
        registry.load("a" * 64)
    message = str(caught.value)
    assert str(registry.path("a" * 64)) in message and problem in message
    assert f"delete {registry.path('a' * 64)} to record a new baseline" in message


def test_pruning_old_run_workspaces_keeps_the_baselines_and_the_latest_pointer(tmp_path: Path) -> None:
    registry = BaselineRegistry(tmp_path / BASELINES_DIR)
    registry.record(_baseline())
    roots = [open_workspace(tmp_path / new_run_id(), keep=1).root for _ in range(3)]
    mark_latest(open_workspace(tmp_path / new_run_id(), keep=1))
    open_workspace(tmp_path / new_run_id(), keep=1)
    assert registry.load("a" * 64) is not None
    assert all(not root.exists() for root in roots)
    assert registry.folder not in run_workspaces(tmp_path)
    assert latest_run(tmp_path) is not None and latest_run(tmp_path).exists()


def test_the_registry_sits_beside_the_run_workspaces_also_for_the_nightly(tmp_path: Path, dataset: str) -> None:
    train = _train(tmp_path, dataset)
    assert (
        registry_for(AcceptanceConfig(work_url=str(tmp_path / "acc")), train).folder == tmp_path / "acc" / "baselines"
    )
    assert registry_for(AcceptanceConfig(), train).folder == tmp_path / "acceptance" / "baselines"


def _run(folder: Path, losses: list[float], val_loss: float) -> Path:
    writer = RunOutputWriter(str(folder), StorageConfig())
    for step, loss in enumerate(losses, start=1):
        writer.append_metrics(StepRecord(step=step, loss=loss))
    writer.write_result(RunResult(len(losses), None, 2, losses[0], losses[-1], val_loss, math.exp(val_loss), 0, 0, 0))
    writer.close()
    return folder


def test_the_first_recorded_run_becomes_the_baseline_a_worse_run_fails_against(tmp_path: Path, dataset: str) -> None:
    train, acceptance = _train(tmp_path, dataset), AcceptanceConfig()
    curve = [5.5 - 0.1 * s for s in range(20)]
    first = judge_quality(acceptance, train, train, 2, _run(tmp_path / "one", curve, 3.5))
    assert first.result.passed and first.result.measured["rule"] == "sanity"
    assert first.record(tmp_path / "ws-1", tmp_path / "one") is True
    stored = first.registry.load(first.key)
    assert stored is not None and stored.run_id == "ws-1" and stored.val_loss == 3.5 and stored.curve[20] == curve[-1]
    assert first.result.evidence == {"baseline_file": str(first.registry.path(first.key)), "recorded": True}

    same = judge_quality(acceptance, train, train, 2, _run(tmp_path / "two", curve, 3.5))
    assert same.result.passed and same.result.measured["rule"] == "baseline"
    assert same.record(tmp_path / "ws-2", tmp_path / "two") is False  # compared with the first, never replaces it
    worse = judge_quality(acceptance, train, train, 2, _run(tmp_path / "three", [x + 0.5 for x in curve], 4.0))
    assert worse.result.passed is False
    assert "4.0000" in worse.result.message and "3.5000" in worse.result.message
    assert worse.result.evidence["baseline_run_id"] == "ws-1"


def test_a_malformed_baseline_fails_the_gate_with_its_name_instead_of_raising(tmp_path: Path, dataset: str) -> None:
    train, acceptance = _train(tmp_path, dataset), AcceptanceConfig()
    output = _run(tmp_path / "one", [5.5, 4.0], 3.5)
    key = judge_quality(acceptance, train, train, 2, output).key
    registry = registry_for(acceptance, train)
    registry.folder.mkdir(parents=True)
    registry.path(key).write_text("[]")
    gate = judge_quality(acceptance, train, train, 2, output)
    assert gate.result.passed is False and str(registry.path(key)) in gate.result.message
    assert "delete" in gate.result.look_first
    assert gate.record(tmp_path / "ws", output) is False and registry.path(key).read_text() == "[]"


def test_an_unfinished_run_leaves_the_gate_unmeasured(tmp_path: Path, dataset: str) -> None:
    gate = judge_quality(AcceptanceConfig(), _train(tmp_path, dataset), _train(tmp_path, dataset), 2, tmp_path / "x")
    assert gate.result.passed is None and "wrote no result" in gate.result.message
    assert gate.record(tmp_path / "ws", tmp_path / "x") is False


class _FinishedJob:
    """Stands in for a submitted job: writes a finished run output with the curve `curves[name]` at once."""

    curves: dict[str, tuple[list[float], float]] = {}

    def __init__(self, cluster: Any, train: TrainConfig, name: str, *args: Any, **kwargs: Any) -> None:
        self.output_dir = Path(train.run.output_url)
        losses, val_loss = self.curves.get(name, ([5.5, 4.0], 3.5))
        _run(self.output_dir, losses, val_loss)
        handle = JobHandle("local", name, name, str(self.output_dir), str(self.output_dir / "train.log"))
        self.outcome = RunOutcome(handle, JobStatus(JobState.SUCCEEDED, "done"), self.output_dir)

    def wait(self, *args: Any, **kwargs: Any) -> RunOutcome:
        return self.outcome

    def goodput(self) -> None:
        return None


def _dimension(name: str, passed: bool = True) -> DimensionResult:
    measured = {"max_rel_deviation": 0.0} if name == "correctness" else None
    return DimensionResult(name=name, passed=passed, measured=measured)


@pytest.fixture
def fake_suite(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """run_acceptance with jobs that finish at once and dimensions/drill verdicts the test sets."""
    verdicts = {"stability": True, "rank_kill": True}
    names = ("connectivity", "correctness", "performance", "stability", "data_consistency")
    monkeypatch.setattr(suite, "Job", _FinishedJob)
    monkeypatch.setattr(suite, "judge", lambda *args, **kwargs: [_dimension(n, verdicts.get(n, True)) for n in names])
    monkeypatch.setattr(
        suite,
        "drill_rank_kill",
        lambda ctx: (
            DrillResult("rank_kill", verdicts["rank_kill"], evidence={"output_dir": "unused"}),
            _dimension("recovery", verdicts["rank_kill"]),
        ),
    )
    monkeypatch.setattr(suite, "check_data_consistency", lambda *args, **kwargs: _dimension("data_consistency"))
    monkeypatch.setattr(suite, "with_resumed_run", lambda dimension, resumed: dimension)
    return verdicts


def test_the_suite_records_the_first_fully_accepted_run_and_judges_later_ones_against_it(
    tmp_path: Path, dataset: str, fake_suite: dict[str, bool]
) -> None:
    spec = parse_spec(deep_merge(TINY_SPEC, {"data": {"dataset_url": dataset}, "deployment_dir": str(tmp_path)}))
    train, acceptance = spec.training_config(), spec.acceptance.model_copy(update={"steps": 20})
    registry = registry_for(acceptance, train)

    def accept(curve: list[float], val_loss: float) -> tuple[bool, DimensionResult]:
        _FinishedJob.curves = {"accept-distributed": (curve, val_loss)}
        folder = DeploymentPaths.of(spec).deployment_dir
        inputs = suite.AcceptanceInputs(cluster=spec.cluster, train=train, acceptance=acceptance, deployment_dir=folder)
        report = suite.run_acceptance(inputs, tmp_path / "acceptance" / new_run_id())
        return report.passed, next(d for d in report.dimensions if d.name == "correctness")

    for failing in ("stability", "rank_kill"):  # a failed dimension or drill records nothing
        fake_suite[failing] = False
        passed, correctness = accept([5.5, 4.0], 3.5)
        assert not passed and correctness.passed and not any(registry.folder.glob("*.json"))
        fake_suite[failing] = True
    passed, first = accept([5.5, 4.0], 3.5)
    assert passed and first.measured["quality"]["rule"] == "sanity" and first.evidence["quality"]["recorded"]
    (stored,) = registry.folder.glob("*.json")
    assert registry.folder == tmp_path / "acceptance" / "baselines"
    assert Baseline.model_validate_json(stored.read_text()).deployment_dir == str(tmp_path)

    passed, worse = accept([5.5, 4.5], 4.0)
    assert not passed and not worse.passed and worse.measured["quality"]["rule"] == "baseline"
    assert "4.0000" in worse.message and "3.5000" in worse.message
    passed, better = accept([5.5, 3.9], 3.4)
    assert passed and better.passed and not better.evidence["quality"]["recorded"]
    assert Baseline.model_validate_json(stored.read_text()).val_loss == 3.5  # the first baseline stays
