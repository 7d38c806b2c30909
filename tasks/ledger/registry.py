"""The deployment ledger: one entry per accepted deployment, the current baseline, rollback marks.

Where: `acceptance.ledger_url` (any fsspec URL, e.g. s3://bucket/prefix to share it between machines), else
`<acceptance work folder>/ledger` (runs/<name>/acceptance/ledger): beside the run workspaces and `baselines/`,
shared by the nightly runs, and outside every run-id folder, so workspace pruning never reaches it.

    <ledger>/entries/<entry-id>.json      one accepted deployment (written once, never rewritten)
    <ledger>/rollbacks/<entry-id>.json    that entry was rolled back (a separate file: entries stay as written)
    <ledger>/serving/<entry-id>.json      the serving check of that entry's accepted checkpoint (its P99; the
                                          pipeline's serving step runs after acceptance wrote the entry)
    <ledger>/checkpoints/<entry-id>/      a copy of the entry's accepted checkpoint (pinned against retention)

Entry ids are run ids (`tasks.run_id.new_run_id`): they sort by time. An entry is created
exclusively and atomically: on local disks a temporary file hard-linked to its name (fails when it exists), on
object stores one PUT of a new key. The checkpoint copy writes COMMIT.json last, so an interrupted copy is a
partial checkpoint, never a finished one. The "current baseline" of a spec and cluster is the newest entry of
that spec name and cluster identity that is not rolled back; the quality gate (baselines.py) and the regression
gate (`check_regression`) both compare with it.

Files sit on shared storage and are read as untrusted. With the checkpoint signing key set (TDEPLOY_CHECKPOINT_KEY,
or the Prefect Secret block `tdeploy-checkpoint-key` that the flows put into it), every file written here (entries,
rollback marks, serving records) carries `hmac_sha256`, an HMAC-SHA256 of its canonical JSON without that field,
made as a checkpoint's COMMIT.json signature is (training/checkpoint/trust.py). A reader with the key refuses a
file that is unsigned or whose signature differs; without a key files are read unauthenticated, as written before.
Listing (`entries`, `rolled_back`, a serving figure) skips a refused or malformed file with a warning naming it, so
one bad file never hides the others; asking for one entry by id raises LedgerError with its name and the fix.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from statistics import median
from typing import TYPE_CHECKING, Any

from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.errors import UserError
from tasks.launch.cluster import ClusterConfig
from tasks.run_id import RUN_ID
from training.config import TrainConfig, first_problem
from training.run_output import RunOutput
from training.signing import KEY_ENV, SIGNATURE_FIELD, checkpoint_key, sign_commit
from training.storage import (
    ControlFileError,
    StorageConfig,
    filesystem,
    join,
    read_control_file,
)
from validation.acceptance import ConnectivityFigures, DimensionResult, PerformanceFigures, figures_of
from validation.goodput import GoodputField
from validation.plan_accuracy import PlanAccuracy
from validation.quality import LossCurve, loss_curve

if TYPE_CHECKING:
    from tasks.image.step import ImageStepResult
    from tasks.spec import DeploymentSpec
    from training.workload import DataManifest

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENTRIES, ROLLBACKS, CHECKPOINTS, SERVING = "entries", "rollbacks", "checkpoints", "serving"
_ENTRY_FILE = re.compile(r"^(" + RUN_ID.pattern.strip("^$") + r")\.json$")
_SHA256 = r"^[0-9a-f]{64}$"


class LedgerError(UserError):
    """A ledger file that cannot be used (unreadable, not JSON, wrong fields, another entry's)."""

    def __init__(self, path: str, problem: str, fix: str | None = None) -> None:
        fix = fix or (
            f"move {path} out of the ledger (entries are written once by an accepted acceptance run and never "
            "edited; restore it from a backup, or accept the deployment again to record a new one)"
        )
        super().__init__(f"ledger file {path}: {problem}", fix)
        self.path, self.problem = path, problem


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class CheckpointRef(_Record):
    """The accepted checkpoint: its folder (what a trainer's checkpoint.url names), step and COMMIT.json's digest."""

    url: str = Field(min_length=1, description="The checkpoint folder (step-<N>/ inside it).")
    step: int = Field(ge=0, description="The accepted step.")
    commit_sha256: str = Field(pattern=_SHA256, description="sha256 of that step's COMMIT.json.")


class GoldenFigures(_Record):
    """The figures of the entry's acceptance run (None: not measured)."""

    loss_curve: dict[int, float] = Field(description="Training loss per step (rank 0) at the fixed seed.")
    first_loss: float = Field(description="Training loss of the first step.")
    final_loss: float = Field(description="Training loss of the last step.")
    val_loss: float = Field(description="Final validation loss.")
    tokens_per_s: float | None = Field(default=None, gt=0, description="Steady-state tokens/s (all ranks).")
    step_time_s: float | None = Field(default=None, gt=0, description="Median step time of rank 0.")
    timed_s: float | None = Field(
        default=None, gt=0, description="Seconds the steady-state steps (tokens/s and step time) took in all, wall."
    )
    tokens_per_cpu_s: float | None = Field(
        default=None,
        gt=0,
        description="Steady-state tokens per second of CPU time: a step's tokens over the largest process CPU time "
        "of a rank in it (CPU runs; a busy host stretches wall time, not CPU time).",
    )
    step_cpu_s: float | None = Field(
        default=None, gt=0, description="Median over steps of the largest process CPU time of a rank (CPU runs)."
    )
    cpu_timed_s: float | None = Field(
        default=None, gt=0, description="CPU seconds of those steps in all (the largest rank's per step)."
    )
    comm_share: float | None = Field(default=None, ge=0, description="Largest per-rank communication share.")
    checkpoint_save_s: float | None = Field(default=None, ge=0, description="Median checkpoint save time.")
    busbw_gbps: float | None = Field(default=None, ge=0, description="All-reduce bus bandwidth (comm probe).")
    busbw_timed_s: float | None = Field(
        default=None, ge=0, description="Seconds the probe's timed all-reduces of that size took in all."
    )
    serving_p99_ms: float | None = Field(default=None, ge=0, description="Serving P99 end-to-end latency.")

    def curve(self) -> LossCurve:
        """The figures the quality gate compares with."""
        return LossCurve(dict(self.loss_curve), self.val_loss, self.first_loss)


class LedgerEntry(_Record):
    """One accepted deployment."""

    format_version: int = Field(default=FORMAT_VERSION, description="Format of this file.")
    entry_id: str = Field(pattern=RUN_ID.pattern, description="Sorts by time; the file's name.")
    created_at: str = Field(description="When it was recorded (UTC, ISO 8601).")
    spec_name: str = Field(description="The spec's name ('' when acceptance ran without one).")
    spec_digest: str | None = Field(default=None, pattern=_SHA256, description="sha256 of the canonical spec.")
    cluster_key: str = Field(pattern=_SHA256, description="sha256 of `cluster`.")
    cluster: dict[str, Any] = Field(description="What the cluster identity covers.")
    curve_key: str = Field(pattern=_SHA256, description="The quality baseline key (baselines.curve_identity).")
    image_ref: str | None = Field(default=None, description="The image the jobs ran in (None: the nodes' own).")
    image_digest: str | None = Field(default=None, description="Its digest, when known.")
    code_version: str = Field(description="The package version, plus '+g<commit>' when the git commit is known.")
    dataset_key: str = Field(pattern=_SHA256, description="sha256 of the dataset manifest's checksums.")
    train: dict[str, Any] = Field(description="The spec's training config (what a rollback resubmits).")
    checkpoint: CheckpointRef | None = Field(description="The accepted checkpoint (None: the run saved none).")
    figures: GoldenFigures
    acceptance_run: str = Field(description="The acceptance run workspace it came from.")
    plan_accuracy: PlanAccuracy | None = Field(
        default=None, description="The capacity plan beside what the run measured (None: planned without a plan)."
    )
    goodput: GoodputField | None = Field(
        default=None, description="The accepted run's goodput and badput by kind (None: entries from before it)."
    )

    def line(self) -> str:
        """One line for `tdeploy history`."""
        f = self.figures
        step = self.checkpoint.step if self.checkpoint else "-"
        tps = f"{f.tokens_per_s:.0f}" if f.tokens_per_s else "-"
        goodput = f"{100 * self.goodput.goodput:.1f}%" if self.goodput else "-"
        return (
            f"{self.entry_id}  {self.created_at}  image {self.image_ref or '-'}  code {self.code_version}  "
            f"step {step}  tokens/s {tps}  final loss {f.final_loss:.4f}  goodput {goodput}"
        )


class RollbackMark(_Record):
    """An entry that was rolled back: when, to which entry, and why."""

    entry_id: str = Field(pattern=RUN_ID.pattern)
    rolled_back_at: str
    restored_entry: str = Field(pattern=RUN_ID.pattern)
    reason: str = ""


class ServingRecord(_Record):
    """The serving check of an entry's accepted checkpoint: the first one is the entry's golden serving figure."""

    format_version: int = Field(default=FORMAT_VERSION, description="Format of this file.")
    entry_id: str = Field(pattern=RUN_ID.pattern, description="The entry whose checkpoint was served.")
    recorded_at: str = Field(description="When (UTC, ISO 8601).")
    step: int = Field(ge=0, description="The served checkpoint's step (the entry's accepted step).")
    p99_e2e_ms: float = Field(ge=0, description="P99 end-to-end request latency of the load test.")
    p99_ttft_ms: float | None = Field(default=None, ge=0, description="P99 time to first token.")
    output_tokens_per_s: float | None = Field(default=None, ge=0, description="Output tokens/s of the load test.")


@dataclass(frozen=True)
class Provenance:
    """What acceptance cannot see by itself: the spec's name and digest and the image it ran."""

    spec_name: str = ""
    spec_digest: str | None = None
    image_ref: str | None = None
    image_digest: str | None = None

    @classmethod
    def of(cls, spec: DeploymentSpec, image: ImageStepResult | None = None, image_ref: str | None = None) -> Provenance:
        """The spec's name and digest, and the image the jobs run in (`image`'s record, else `image_ref`)."""
        record = (image.record if image is not None else None) or {}
        ref = image.job_image if image is not None else image_ref
        digest = record.get("digest") if ref else None
        return cls(spec.name, spec.digest(), ref, digest if isinstance(digest, str) else None)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _sha256(value: Any) -> str:
    return hashlib.sha256(_canonical(value).encode()).hexdigest()


def cluster_identity(cluster: ClusterConfig) -> dict[str, Any]:
    """What makes two runs' timings comparable: the scheduler, the node count and shape, the accelerator."""
    return {
        "scheduler": cluster.scheduler,
        "nodes": cluster.nodes,
        "procs_per_node": cluster.procs_per_node,
        "accelerator": cluster.accelerator,
    }


def cluster_key_of(cluster: ClusterConfig) -> str:
    """sha256 of `cluster_identity`."""
    return _sha256(cluster_identity(cluster))


def dataset_key(manifest: DataManifest) -> str:
    """sha256 over the manifest's checksums (every split's shards and the tokenizer)."""
    return _sha256(manifest.checksums())


def code_version() -> str:
    """The installed package's version, plus the git commit of this checkout when there is one."""
    try:
        version = metadata.version("transformer-deploy")
    except metadata.PackageNotFoundError:
        version = "unknown"
    try:
        commit = subprocess.run(
            ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "--short=12", "HEAD"],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return version
    return f"{version}+g{commit}" if re.fullmatch(r"[0-9a-f]{7,40}", commit) else version


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) and value > 0 else None


class NonFiniteFigures(ValueError):
    """A finished run's loss figures are NaN or infinite (it diverged): nothing to hold against a baseline or to
    record as one."""

    def __init__(self, output_dir: Path, figures: dict[str, float]) -> None:
        bad = ", ".join(f"{name}={value}" for name, value in figures.items() if not math.isfinite(value))
        super().__init__(
            f"{output_dir}: {bad}: the run's loss is not finite, so it is neither compared with the baseline nor "
            "recorded; the stability dimension names the first step whose loss was not finite"
        )
        self.output_dir, self.figures = output_dir, figures


def golden_figures(dimensions: list[DimensionResult], output_dir: Path) -> GoldenFigures | None:
    """The figures of a finished acceptance run from its dimensions and its output (None: it wrote no result);
    NonFiniteFigures when its losses are not finite numbers."""
    curve = loss_curve(output_dir)
    if curve is None:
        return None
    finite = [v for v in curve.losses.values() if math.isfinite(v)]
    if not finite or not math.isfinite(curve.val_loss) or not math.isfinite(curve.first_loss):
        last = curve.losses[max(curve.losses)]
        raise NonFiniteFigures(
            output_dir, {"first_loss": curve.first_loss, "final_loss": last, "val_loss": curve.val_loss}
        )
    perf = figures_of(dimensions, PerformanceFigures) or PerformanceFigures()
    probe = figures_of(dimensions, ConnectivityFigures) or ConnectivityFigures()
    run = RunOutput(output_dir)
    times = [m.step_time_s for s, m in run.metrics().items() if s > min(curve.losses) and m.step_time_s]
    saves = [c.seconds for c in run.checkpoints() if c.error is None and c.seconds is not None]
    losses = {s: v for s, v in curve.losses.items() if math.isfinite(v)}  # fp16 skipped steps: inf
    return GoldenFigures(
        loss_curve=losses,
        first_loss=curve.first_loss,
        final_loss=losses[max(losses)],
        val_loss=curve.val_loss,
        tokens_per_s=_finite(perf.tokens_per_s),
        step_time_s=_finite(median(times)) if times else None,
        timed_s=_finite(perf.timed_s),
        tokens_per_cpu_s=_finite(perf.tokens_per_cpu_s),
        step_cpu_s=_finite(perf.step_cpu_s),
        cpu_timed_s=_finite(perf.cpu_timed_s),
        comm_share=perf.comm_share if perf.comm_share is not None and math.isfinite(perf.comm_share) else None,
        checkpoint_save_s=float(median(saves)) if saves else None,
        busbw_gbps=_finite(probe.busbw_gbps),
        busbw_timed_s=_finite(probe.busbw_timed_s),
    )


class Ledger:
    """The ledger folder at `url` (see the module docstring)."""

    def __init__(self, url: str, storage: StorageConfig | None = None) -> None:
        self.url, self.storage = url, storage or StorageConfig()
        self.fs, self.root = filesystem(url, self.storage)
        self.key = checkpoint_key()  # None: files are written unsigned and read unauthenticated
        self._warned: set[str] = set()

    def _path(self, kind: str, entry_id: str) -> str:
        assert RUN_ID.match(entry_id), entry_id  # ids are validated (spec boundary, CLI) or our own
        return join(self.root, kind, f"{entry_id}.json")

    def checkpoint_url(self, entry_id: str) -> str:
        """Where the accepted checkpoint of `entry_id` is kept."""
        assert RUN_ID.match(entry_id), entry_id
        return join(self.url, CHECKPOINTS, entry_id)

    def _create(self, path: str, data: bytes) -> bool:
        """Create `path` exclusively and atomically; False when it exists."""
        if isinstance(self.fs, LocalFileSystem):
            folder = os.path.dirname(path)
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".ledger-", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                try:
                    os.link(tmp, path)  # atomic and exclusive
                except FileExistsError:
                    return False
            finally:
                os.unlink(tmp)
            return True
        if self.fs.exists(path):
            return False
        self.fs.pipe_file(path, data)  # one PUT of a new key: visible whole or not at all
        return True

    def _encode(self, record: BaseModel) -> bytes:
        """The file's content: the record's JSON, signed when the key is set."""
        data = json.loads(record.model_dump_json())  # JSON types (string keys): what a reader parses back
        if self.key is not None:
            data = sign_commit(data, self.key)  # the same signature as a checkpoint's COMMIT.json
        return json.dumps(data, indent=2).encode()

    def _signature_problem(self, path: str, data: dict[str, Any]) -> LedgerError | None:
        """Why `data` (a parsed file) must not be believed under the key (None: believe it, or no key is set)."""
        if self.key is None:
            return None
        signature = data.get(SIGNATURE_FIELD)
        if signature is None:
            return LedgerError(
                path,
                f"not signed ({SIGNATURE_FIELD} is missing) while {KEY_ENV} is set: written by hand, written before "
                "the key was set, or its signature removed",
                f"move {path} out of the ledger and check who can write to {self.url}; an entry recorded before "
                "the key was set is re-recorded signed by accepting the deployment again",
            )
        expected = sign_commit(data, self.key)[SIGNATURE_FIELD]
        if not isinstance(signature, str) or not hmac.compare_digest(signature, expected):
            return LedgerError(
                path,
                f"its signature ({SIGNATURE_FIELD}) does not match {KEY_ENV}: altered after it was written, or "
                "signed with another key",
                f"move {path} out of the ledger and check who can write to {self.url}; if the key was changed, set "
                f"{KEY_ENV} to the key the ledger was written with",
            )
        return None

    def _read(self, path: str, model: type[BaseModel]) -> Any:
        try:
            raw = read_control_file(self.fs, path)
        except ControlFileError as err:
            raise LedgerError(path, err.problem) from err
        except OSError as err:
            raise LedgerError(path, f"cannot be read ({getattr(err, 'strerror', None) or err})") from err
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            raise LedgerError(path, f"not a valid {model.__name__} (not JSON: {type(err).__name__})") from err
        if not isinstance(data, dict):
            raise LedgerError(path, f"not a valid {model.__name__} (not a JSON object)")
        refused = self._signature_problem(path, data)
        if refused is not None:
            raise refused
        data.pop(SIGNATURE_FIELD, None)
        try:
            record = model.model_validate(data)
        except ValidationError as err:
            raise LedgerError(path, f"not a valid {model.__name__} ({first_problem(err)})") from err
        name_id = path.rstrip("/").rsplit("/", 1)[-1].removesuffix(".json")
        if getattr(record, "format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise LedgerError(path, f"format_version={record.format_version}, this reader knows {FORMAT_VERSION}")
        if record.entry_id != name_id:
            raise LedgerError(path, f"records entry {record.entry_id}, not its file name's {name_id}")
        return record

    def _skip(self, err: LedgerError) -> None:
        """Warn, once per file, that a file is left out of a listing."""
        if err.path not in self._warned:
            self._warned.add(err.path)
            log.warning("%s: skipped; %s", err.message, err.fix)

    def _read_each(self, kind: str, model: type[BaseModel]) -> dict[str, Any]:
        """The readable files of `kind`, by id; each one refused is skipped with a warning naming it."""
        records = {}
        for entry_id in self._ids(kind):
            try:
                records[entry_id] = self._read(self._path(kind, entry_id), model)
            except LedgerError as err:
                self._skip(err)
        return records

    def _ids(self, kind: str) -> list[str]:
        folder = join(self.root, kind)
        if not self.fs.exists(folder):
            return []
        names = (p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(folder, detail=False))
        return sorted(m.group(1) for m in map(_ENTRY_FILE.match, names) if m)  # temporary files start with '.'

    def append(self, entry: LedgerEntry) -> str:
        """Write a new entry (never overwrites one); its path."""
        path = self._path(ENTRIES, entry.entry_id)
        if not self._create(path, self._encode(entry)):
            raise LedgerError(path, "exists already", "entry ids are unique: record the entry under a new id")
        log.info("ledger: recorded entry %s", path)
        return path

    def entries(self) -> list[LedgerEntry]:
        """Every entry, oldest first, with its serving figure where its checkpoint was served; a malformed,
        unsigned or tampered file is skipped with a warning naming it."""
        served = self._ids(SERVING)
        return [self._with_serving(e, served) for e in self._read_each(ENTRIES, LedgerEntry).values()]

    def plan_accuracies(self, accelerator: str) -> list[PlanAccuracy]:
        """The plan-vs-run records of the accepted runs on `accelerator`, oldest first (rolled-back entries too:
        their runs measured what they measured)."""
        return [
            e.plan_accuracy
            for e in self.entries()
            if e.plan_accuracy is not None and e.cluster.get("accelerator") == accelerator
        ]

    def entry(self, entry_id: str) -> LedgerEntry:
        """The entry `entry_id` (LedgerError when there is none, or its file is malformed, unsigned or tampered)."""
        if not RUN_ID.match(entry_id) or entry_id not in self._ids(ENTRIES):
            known = ", ".join(self._ids(ENTRIES)[-5:]) or "none yet"
            raise LedgerError(join(self.url, ENTRIES), f"has no entry {entry_id!r}", f"use one of: {known}")
        return self._with_serving(self._read(self._path(ENTRIES, entry_id), LedgerEntry), self._ids(SERVING))

    def _with_serving(self, entry: LedgerEntry, served: list[str]) -> LedgerEntry:
        """`entry` with its serving record's P99 among its figures (the entry file itself is never rewritten)."""
        if entry.entry_id not in served or entry.figures.serving_p99_ms is not None:
            return entry
        try:
            record = self._read(self._path(SERVING, entry.entry_id), ServingRecord)
        except LedgerError as err:
            self._skip(err)
            return entry
        figures = entry.figures.model_copy(update={"serving_p99_ms": record.p99_e2e_ms})
        return entry.model_copy(update={"figures": figures})

    def record_serving(self, record: ServingRecord) -> bool:
        """Record the serving check of an entry's accepted checkpoint; False (kept as it was) when one is recorded
        already: the first is the entry's golden figure. LedgerError when the entry does not exist or its
        accepted checkpoint is not the served step."""
        entry = self.entry(record.entry_id)
        if entry.checkpoint is None or entry.checkpoint.step != record.step:
            accepted = entry.checkpoint.step if entry.checkpoint else None
            raise LedgerError(
                self._path(ENTRIES, record.entry_id),
                f"accepted step {accepted}, but the serving check served step {record.step}",
                "serve the accepted checkpoint (tdeploy check-serving SPEC --step N) to record its figures",
            )
        return self._create(self._path(SERVING, record.entry_id), self._encode(record))

    def rolled_back(self) -> dict[str, RollbackMark]:
        """The rollback marks, by the entry they mark (one refused is skipped with a warning naming it)."""
        return self._read_each(ROLLBACKS, RollbackMark)

    def mark_rolled_back(self, entry_ids: list[str], restored: str, reason: str = "") -> list[str]:
        """Mark `entry_ids` rolled back in favour of `restored` (a mark that exists stays as it is)."""
        now = datetime.now(UTC).isoformat(timespec="seconds")
        marked = []
        for entry_id in entry_ids:
            mark = RollbackMark(entry_id=entry_id, rolled_back_at=now, restored_entry=restored, reason=reason)
            if self._create(self._path(ROLLBACKS, entry_id), self._encode(mark)):
                marked.append(entry_id)
        return marked

    def lineage(self, spec_name: str, cluster_key: str) -> list[LedgerEntry]:
        """The entries of one spec and cluster that are not rolled back, oldest first (an entry recorded without a
        spec name, by `tdeploy accept`, belongs to whichever spec uses this ledger; a query without one matches
        only those)."""
        gone = self.rolled_back()
        return [
            e
            for e in self.entries()
            if e.entry_id not in gone and e.cluster_key == cluster_key and e.spec_name in (spec_name, "")
        ]

    def current(self, spec_name: str, cluster_key: str, curve_key: str | None = None) -> LedgerEntry | None:
        """The current baseline: the newest entry of the spec and cluster that is not rolled back; with
        `curve_key`, the newest of those with that curve identity where there is one (a nightly soak and the
        deployment's acceptance each keep theirs)."""
        lineage = self.lineage(spec_name, cluster_key)
        same = [e for e in lineage if e.curve_key == curve_key]
        return (same or lineage or [None])[-1]

    def keep_checkpoint(self, entry_id: str, deployment: TrainConfig, accepted: TrainConfig) -> CheckpointRef | None:
        """Pin the accepted checkpoint against retention; None when there is none.

        The deployment's own newest sound checkpoint (deployment.checkpoint: what its training job saved) is
        pinned where it is; without one, the acceptance run's (`accepted`, in a workspace that pruning deletes)
        is copied into the ledger's checkpoints/<entry-id>/ first.
        """
        from training.checkpoint import CheckpointManager, commit_digest, copy_step  # torch: only when accepting

        own = CheckpointManager(deployment.checkpoint, deployment.storage)
        found = own.latest_sound()
        if found is not None:
            url, step, manager = deployment.checkpoint.url, found[0], own
        else:
            source = CheckpointManager(accepted.checkpoint, accepted.storage)
            found = source.latest_sound()
            if found is None:
                return None
            step, url = found[0], self.checkpoint_url(entry_id)
            copy_step(source.step_url(step), url, accepted.storage)
            manager = CheckpointManager(accepted.checkpoint.model_copy(update={"url": url}), accepted.storage)
        manager.pin(step, entry_id)
        return CheckpointRef(url=url, step=step, commit_sha256=commit_digest(manager.step_url(step), manager.storage))
