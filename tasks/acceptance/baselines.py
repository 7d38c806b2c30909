"""The baseline registry: the golden loss curve of each spec and seed, recorded by the first accepted run.

A folder `baselines/` beside the acceptance run workspaces (`<work_url>/baselines/<key>.json`, shared by the
nightly runs; run-workspace pruning only ever deletes run-id folders) holds one JSON file per key. The key is
the sha256 of everything that determines the distributed run's loss curve (`curve_identity`): the model,
optimizer and precision sections, the batch (micro-batch, accumulation, world size), the dataset's content
(the manifest's checksums and tokenizer identity of the training and validation splits), the seed, the steps
and the evaluation batches. Paths, names, thresholds and timing settings are left out, so moving a deployment
keeps its baseline and changing its mathematics starts a new one.

The deployment ledger (tasks/ledger) takes precedence: where its current baseline (the newest accepted entry
of the spec and cluster not rolled back) has the run's key, its curve is the baseline (`judge_quality`'s
`current`); the file here stays the first accepted run's, used only while the ledger has no entry of the key.

A baseline is written once, atomically (a hard link that fails when the file exists), and only when the whole
acceptance passed; it is never overwritten: a later accepted run is compared with the first. Baselines may sit
on shared storage and are read as untrusted files: a malformed one is refused with its name and the fix
(delete it; the next accepted run records a new one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.acceptance.config import AcceptanceConfig
from tasks.errors import UserError
from tasks.paths import baselines_dir
from training.config import TrainConfig, first_problem
from validation.quality import LossCurve, QualityResult, check_quality, loss_curve, not_measured

if TYPE_CHECKING:
    from training.workload import DataManifest

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
KEY_VERSION = 1
"""Bumped whenever `curve_identity` changes what it covers, so old baselines are no longer found."""
_KEY = re.compile(r"^[0-9a-f]{64}$")


class BaselineError(UserError):
    """A baseline file that cannot be used (not JSON, wrong fields or types, another key's)."""

    def __init__(self, path: Path, problem: str) -> None:
        fix = f"delete {path} to record a new baseline with the next accepted run"
        super().__init__(f"baseline {path}: {problem}", fix)
        self.path, self.problem = path, problem


class Baseline(BaseModel):
    """One recorded golden run: its key, when and where it came from, its curve and final losses."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    format_version: int = Field(default=FORMAT_VERSION, description="Format of this file.")
    key: str = Field(pattern=_KEY.pattern, description="sha256 of `identity`; the file's name.")
    created_at: str = Field(description="When it was recorded (UTC, ISO 8601).")
    deployment_dir: str | None = Field(
        default=None,
        description="The deployment folder its acceptance ran under (runs/<spec name> unless the spec says "
        "otherwise; None: its acceptance was run without a spec's folder).",
    )
    run_id: str = Field(description="The acceptance run workspace it came from (its folder name).")
    workspace: str = Field(description="That workspace's folder.")
    output_dir: str = Field(description="The distributed run's output folder in it.")
    identity: dict[str, Any] = Field(description="What the key covers, to tell why two keys differ.")
    curve: dict[int, float] = Field(description="Training loss per step (rank 0).")
    val_loss: float = Field(description="Final validation loss.")
    first_loss: float = Field(description="Training loss of the first step.")

    def loss_curve(self) -> LossCurve:
        """The figures the quality gate compares with."""
        return LossCurve(dict(self.curve), self.val_loss, self.first_loss)


def curve_identity(train: TrainConfig, world_size: int, manifest: DataManifest) -> dict[str, Any]:
    """Everything that determines the loss curve of `train` (the acceptance run's config) on `world_size`
    data-parallel ranks (the job's processes with the tensor and pipeline degrees divided out: the layout does not
    change the mathematics, the global batch does)."""
    par = train.parallel
    # model.init_from only when set: the keys of runs from random weights stay those recorded before it existed.
    # model.vision.init_from likewise (the keys of vision runs from random weights stay as before it existed).
    exclude: dict[str, Any] = {"init_from": True} if train.model.init_from is None else {}
    if train.model.vision is not None and train.model.vision.init_from is None:
        exclude["vision"] = {"init_from": True}
    model = train.model.model_dump(mode="json", exclude=exclude or None)
    return {
        "key_version": KEY_VERSION,
        "model": model,
        "optim": train.optim.model_dump(mode="json"),
        "precision": train.precision.model_dump(mode="json"),
        "batch": {
            "world_size": world_size,
            "micro_batch": par.micro_batch,
            "grad_accum_steps": par.grad_accum_steps,
            "global_batch": par.micro_batch * par.grad_accum_steps * world_size,
            "ddp_grad_compression": par.ddp_grad_compression,  # lossy: changes the mathematics
        },
        "data": manifest.curve_identity(train.data.train_split, train.data.val_split),
        "run": {
            "seed": train.run.seed,
            "steps": train.run.steps,
            "stop_after_steps": train.run.stop_after_steps,
            "eval_batches": train.run.eval_batches,
        },
    }


def baseline_key(identity: dict[str, Any]) -> str:
    """The sha256 of a curve identity (canonical JSON)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class BaselineRegistry:
    """The folder of baselines, one `<key>.json` each."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, key: str) -> Path:
        """The file of `key`."""
        assert _KEY.match(key), key  # keys are our own sha256 digests
        return self.folder / f"{key}.json"

    def load(self, key: str) -> Baseline | None:
        """The baseline of `key` (None when none is recorded); a malformed file raises BaselineError."""
        path = self.path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            raise BaselineError(path, f"cannot be read ({err.strerror or err})") from err
        try:
            baseline = Baseline.model_validate_json(raw)
        except ValidationError as err:
            raise BaselineError(path, f"not a valid baseline ({first_problem(err)})") from err
        if baseline.format_version != FORMAT_VERSION:
            raise BaselineError(path, f"format_version={baseline.format_version}, this reader knows {FORMAT_VERSION}")
        if baseline.key != key:
            raise BaselineError(path, f"records key {baseline.key}, not its file name's {key}")
        if not baseline.curve:
            raise BaselineError(path, "records an empty curve")
        return baseline

    def record(self, baseline: Baseline) -> bool:
        """Write `baseline` atomically unless its key has one already (never overwritten); True when written."""
        path = self.path(baseline.key)
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".baseline-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(baseline.model_dump_json(indent=2))
                handle.flush()
                os.fsync(handle.fileno())
            try:
                os.link(tmp, path)  # atomic and exclusive: a concurrent or earlier record wins
            except FileExistsError:
                return False
        finally:
            os.unlink(tmp)
        return True


def registry_for(acceptance: AcceptanceConfig, train: TrainConfig) -> BaselineRegistry:
    """The spec's registry: `baselines/` beside its (non-nightly) run workspaces (tasks.paths.baselines_dir)."""
    return BaselineRegistry(baselines_dir(acceptance, train.run.output_url))


@dataclass
class QualityGate:
    """The quality gate of one acceptance run: its verdict and what `record` needs.

    `result.evidence` (the correctness dimension's evidence["quality"]) names the baseline file and says
    whether this run recorded it.
    """

    result: QualityResult
    registry: BaselineRegistry
    key: str | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    curve: LossCurve | None = None
    baseline: Baseline | None = None

    def record(self, workspace: Path, output_dir: Path, deployment_dir: str | None = None) -> bool:
        """Record the run as its key's baseline (call only when the whole acceptance passed), with the deployment
        folder it ran under (tasks.paths); True when written."""
        if self.key is None or self.curve is None or self.baseline is not None:
            return False
        baseline = Baseline(
            key=self.key,
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            deployment_dir=deployment_dir,
            run_id=workspace.name,
            workspace=str(workspace),
            output_dir=str(output_dir),
            identity=self.identity,
            curve={s: v for s, v in self.curve.losses.items() if math.isfinite(v)},  # fp16 skipped steps: inf
            val_loss=self.curve.val_loss,
            first_loss=self.curve.first_loss,
        )
        try:
            written = self.registry.record(baseline)
        except OSError as err:  # the acceptance itself passed: a registry that cannot be written does not undo it
            log.warning("could not record the quality baseline %s: %s", self.registry.path(self.key), err)
            self.result.evidence["record_error"] = str(err)
            return False
        self.result.evidence["recorded"] = written
        if written:
            log.info("recorded quality baseline %s", self.registry.path(self.key))
        return written


def judge_quality(
    acceptance: AcceptanceConfig,
    train: TrainConfig,
    run_train: TrainConfig,
    world_size: int,
    output_dir: Path,
    current: tuple[str, str, str, LossCurve] | None = None,
) -> QualityGate:
    """The quality gate over the distributed run in `output_dir` (config `run_train`, a variant of the spec's
    `train`), against the current baseline, else the sanity rule.

    `current` is the ledger's current baseline (tasks/ledger: its curve key, entry id, run id and curve): when
    its key is the run's, it is the baseline, so that a rollback moves the quality gate's baseline too; otherwise
    the first accepted run's file in this registry is."""
    registry = registry_for(acceptance, train)
    curve = loss_curve(output_dir)
    if curve is None:
        return QualityGate(not_measured(f"the distributed run wrote no result ({output_dir})"), registry)
    from training.workload import workload_of  # torch: the dataset's manifest, read by the acceptance run only

    identity = curve_identity(run_train, world_size, workload_of(run_train).manifest())
    key = baseline_key(identity)
    evidence: dict[str, Any] = {"baseline_file": str(registry.path(key)), "recorded": False}
    try:
        baseline = registry.load(key)
    except BaselineError as err:
        result = QualityResult(False, {"rule": "baseline"}, {}, str(err), err.fix or "", evidence)
        return QualityGate(result, registry, None, identity, curve)
    golden = baseline.loss_curve() if baseline else None
    if current is not None and current[0] == key:
        golden = current[3]
        evidence |= {"baseline_entry": current[1], "baseline_run_id": current[2]}
    elif baseline is not None:
        evidence |= {"baseline_run_id": baseline.run_id, "baseline_created_at": baseline.created_at}
    result = check_quality(curve, golden, acceptance.thresholds)
    result.evidence = evidence
    return QualityGate(result, registry, key, identity, curve, baseline)
