"""The run-output format: its file names, the trainer's writer and the typed reader everybody else uses.

A run's output folder (`run.output_url`) holds, format version 1:

    ranks.json                    written at start-up by rank 0: format_version, world_size, one entry per rank
                                  (its host, pid, device, ..., and `network`: the NCCL_*/GLOO_*/TORCH_* variables
                                  it ran with and its collective timeout; runs from before it have none)
    metrics/rank-NNNNN.jsonl      one StepRecord per optimizer step and rank (step, loss, lr, tokens/s, memory, ...);
                                  its times: step_time_s, data_wait_s, comm_s, compute_s (wall), cpu_s and
                                  compute_cpu_s (the process's CPU time of the step, and of its compute without
                                  data reads and the loss sync; CPU runs), compute_device_s (CUDA events around the
                                  compute; GPU runs); a field a run did not measure is null or, in older runs, absent
    samples/rank-NNNNN.jsonl      the sample indices each rank consumed per step (run.record_samples)
    epochs.jsonl                  one line per epoch that ended: its last step, the remainder it dropped or the
                                  samples it padded with (rank 0, with run.record_samples)
    eval.jsonl                    one line per evaluation: step, val_loss, val_ppl
    checkpoints.jsonl             one line per save: step and bytes/seconds, the seconds training was held by it
                                  (stall_s; runs from before it have none), or the error of a lost save
    attempts.jsonl                one line per start of the trainer (rank 0): the attempt, when its process started
                                  and when the trainer was ready for its first step (unix seconds)
    resume.json                   what the checkpoint manager loaded at start-up and which checkpoints it skipped, why
    result.json                   written at the end by rank 0: steps, losses, tokens seen, ...
    distillation.json             distill runs, written at the end by rank 0: the student and the teacher side by
                                  side, their parameters, validation loss and perplexity on the same batches and
                                  forward tokens per CPU-second (training/distill_report.py)
    params/rank-NNNNN.json        written at the end by every rank: a digest, sum and sum of squares of each piece
                                  of each parameter it holds (name, global offset, shape), to check replicas and
                                  compare with the reference (the reference adds its noise twin's)
    train.log                     the job's log, written by the launcher (not by the trainer)

A step that ran again after a resume appears twice in the JSON-lines files; the
readers keep the later attempt (`sample_records` keeps every attempt). Only this module spells these names: the
trainer writes through `RunOutputWriter`, acceptance, drills, diagnosis, the CLI
and the tests read through `RunOutput`.

Files are written to a local folder. For a remote `output_url` the folder is a
local staging area that is uploaded with `sync()` at every log interval and at
the end, because object stores cannot append. The reader reads local folders.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Literal

from fsspec.implementations.local import LocalFileSystem

from training.storage import (
    ControlFileError,
    StorageConfig,
    filesystem,
    is_local,
    join,
    local_path,
    read_control_file,
)

FORMAT_VERSION = 1

RANKS = "ranks.json"
METRICS_DIR = "metrics"
SAMPLES_DIR = "samples"
EPOCHS = "epochs.jsonl"
EVALS = "eval.jsonl"
CHECKPOINTS = "checkpoints.jsonl"
RESUME = "resume.json"
RESULT = "result.json"
DISTILLATION = "distillation.json"
ATTEMPTS = "attempts.jsonl"
PARAMS_DIR = "params"
TRAIN_LOG = "train.log"

SkipReason = Literal["partial", "corrupt", "untrusted"]


def rank_file(rank: int) -> str:
    """The per-rank JSON-lines file name (`rank-00003.jsonl`)."""
    return f"rank-{rank:05d}.jsonl"


class RunOutputFormatError(Exception):
    """A run-output file this reader cannot read (a newer format, or not what the format says)."""

    def __init__(self, path: Path, problem: str, fix: str) -> None:
        super().__init__(f"{path}: {problem}; {fix}")
        self.path, self.problem, self.fix = path, problem, fix


# ---- records ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ranks:
    """ranks.json: who took part in the job (one dict per rank: rank, host, pid, device, network, ...)."""

    world_size: int
    ranks: list[dict[str, Any]]
    format_version: int = FORMAT_VERSION


@dataclass(frozen=True, kw_only=True)
class StepRecord:
    """One line of metrics/rank-NNNNN.jsonl: one optimizer step of one rank, as both trainers write it (the
    distributed one, training/train.py, and the independent reference, training/reference.py). A figure the run
    did not measure is None (null in the file; runs from before a field existed leave it out)."""

    rank: int = 0
    step: int
    epoch: int | None = None
    loss: float  # mean over the ranks
    rank_loss: float | None = None  # this rank's own
    aux_loss: float | None = None  # MoE load-balancing loss
    distill_kl: float | None = None  # distill: this rank's KL(teacher || student) at the temperature
    lr: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool = False  # the loss scaler skipped the optimizer step
    tokens_per_s: float | None = None  # of the whole job, as this rank timed the step
    tokens_per_s_rank: float | None = None
    step_time_s: float | None = None
    data_wait_s: float | None = None
    comm_s: float | None = None  # gradient collectives in flight (DDP, FSDP)
    compute_s: float | None = None  # wall time less data wait, communication and the loss sync
    tokens: int | None = None  # of the whole job in this step
    cpu_s: float | None = None  # the process's CPU time of the step (CPU runs)
    compute_cpu_s: float | None = None  # of that, the compute without data reads and the loss sync (CPU runs)
    compute_device_s: float | None = None  # CUDA events around the compute (GPU runs)
    peak_mem_bytes: int | None = None
    runtime_mem_bytes: int | None = None
    dropped_tokens: int | None = None  # MoE: tokens over expert capacity
    comm_bytes: dict[str, float] | None = None  # per mesh dimension ("tp", "dp", ...)
    comm_s_per_dim: dict[str, float] | None = None
    time_unix_s: float | None = None  # when the step ended
    gpu_util: float | None = None  # NVML readings (GPU runs with NVML)
    gpu_mem_bytes: float | None = None
    gpu_mem_total_bytes: float | None = None
    gpu_power_w: float | None = None
    twin_loss: float | None = None  # the reference's noise twin (training/reference.py)
    twin_grad_norm: float | None = None
    twin_parts: int | None = None
    memory_copy_before_s: float | None = None  # the in-memory copy between the previous step and this one

    def to_json(self) -> dict[str, Any]:
        """The line as written."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepRecord:
        """From a parsed line (fields this version does not know are ignored); TypeError without step or loss."""
        return cls(**{k: v for k, v in data.items() if k in _STEP_FIELDS})


_STEP_FIELDS = frozenset(f.name for f in fields(StepRecord))


@dataclass(frozen=True)
class EpochEnd:
    """One line of epochs.jsonl: an epoch's last step and what it left out (dropped) or handed out twice (padded)."""

    epoch: int
    step: int
    n_samples: int
    global_batch: int
    dropped: list[int] = field(default_factory=list)
    padded: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class CheckpointEvent:
    """One line of checkpoints.jsonl: a save that committed (bytes, seconds; stall_s: how long training was held by
    it, the whole save when synchronous, the staging when in the background) or was lost (error)."""

    step: int
    bytes: float | None = None
    seconds: float | None = None
    error: str | None = None
    stall_s: float | None = None


@dataclass(frozen=True)
class AttemptRecord:
    """One line of attempts.jsonl: a start of the trainer (rank 0's process) -- `attempt` is torchrun's restart
    count, `started_unix_s` when the process started (before its imports), `ready_unix_s` when the trainer was
    built, restored and about to train."""

    attempt: int
    started_unix_s: float
    ready_unix_s: float
    world_size: int


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A checkpoint the resume passed over: its step, folder, why (partial, corrupt, untrusted) and the detail."""

    step: int
    url: str
    reason: SkipReason
    detail: str


@dataclass(frozen=True)
class ResumeRecord:
    """resume.json: what the checkpoint manager loaded at start-up (loaded_step None: started fresh) and skipped."""

    storage_url: str
    loaded_step: int | None = None
    loaded_url: str | None = None
    saved_world_size: int | None = None
    world_size: int | None = None
    resharded: bool = False
    skipped: list[SkippedCheckpoint] = field(default_factory=list)

    def skipped_step(self, step: int) -> SkippedCheckpoint | None:
        """The skip record of `step` (None when it was not skipped)."""
        return next((s for s in self.skipped if s.step == step), None)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResumeRecord:
        """From the parsed resume.json."""
        skipped = [SkippedCheckpoint(**s) for s in data.get("skipped", [])]
        return cls(**{**data, "skipped": skipped})


@dataclass(frozen=True)
class RunResult:
    """result.json: how far the job got and where the losses ended."""

    steps: int
    resumed_from_step: int | None
    world_size: int
    first_loss: float | None
    final_loss: float | None
    val_loss: float
    val_ppl: float
    skipped_steps: int
    tokens_seen: int
    n_params: int
    teacher_val_loss: float | None = None  # distill: the teacher's validation loss on the same batches


@dataclass(frozen=True)
class ModelFigures:
    """One side of distillation.json: a model's size, its validation loss and its forward speed."""

    params: int
    val_loss: float
    val_ppl: float
    tokens_per_cpu_s: float
    """Forward tokens per CPU-second of one thread (median of the alternating repeats)."""


@dataclass(frozen=True)
class DistillationRecord:
    """distillation.json: the student against its teacher at the end of a distill run, on the same batches."""

    step: int
    student: ModelFigures
    teacher: ModelFigures
    speed_tokens: int
    """Tokens of each timed forward pass (rank 0's validation micro-batches)."""
    speed_repeats: int
    speed_threads: int

    @property
    def speed_ratio(self) -> float:
        """How many times faster the student's forward is than the teacher's (CPU time)."""
        return self.student.tokens_per_cpu_s / self.teacher.tokens_per_cpu_s

    @property
    def params_ratio(self) -> float:
        """The student's share of the teacher's parameters."""
        return self.student.params / self.teacher.params

    def summary(self) -> str:
        """One line: both models' size, loss and speed."""
        s, t = self.student, self.teacher
        return (
            f"distillation at step {self.step}: student {s.params / 1e6:.3g}M params, val_loss {s.val_loss:.4f} "
            f"(ppl {s.val_ppl:.2f}), {s.tokens_per_cpu_s:.4g} tokens/CPU-s; teacher {t.params / 1e6:.3g}M params, "
            f"val_loss {t.val_loss:.4f} (ppl {t.val_ppl:.2f}), {t.tokens_per_cpu_s:.4g} tokens/CPU-s; "
            f"student {self.speed_ratio:.2f}x the teacher's speed at {self.params_ratio:.2f}x its size"
        )

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DistillationRecord:
        """From the parsed file."""
        sides = {k: ModelFigures(**data[k]) for k in ("student", "teacher")}
        return cls(**{**data, **sides})


@dataclass(frozen=True)
class ParamPiece:
    """This rank's piece of one parameter: where it sits in the whole (offset, shape of full_shape), its bytes'
    sha256, and the sum and sum of squares of its values (float64)."""

    name: str
    offset: list[int]
    shape: list[int]
    full_shape: list[int]
    sha256: str
    sum: float
    sq_sum: float


@dataclass(frozen=True)
class ParamRecord:
    """params/rank-NNNNN.json: every parameter piece a rank held at the end of the run (`step`). `tied` maps a
    parameter name to the one it shares its tensor with by definition (model.tie_embeddings); the reference adds
    `twin`, the same parameters of its noise twin (training/reference.py)."""

    rank: int
    step: int
    pieces: list[ParamPiece]
    tied: dict[str, str] = field(default_factory=dict)
    twin: list[ParamPiece] = field(default_factory=list)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ParamRecord:
        """From the parsed file."""
        pieces = {k: [ParamPiece(**p) for p in data.get(k, [])] for k in ("pieces", "twin")}
        return cls(**{**data, **pieces})


# ---- writer -----------------------------------------------------------------------------------


class RunOutputWriter:
    """The run's output folder as the trainer writes it (local, or staged locally for a remote URL)."""

    def __init__(self, url: str, storage: StorageConfig) -> None:
        self.url, self.storage = url, storage
        self.remote = not is_local(url)
        self.dir = Path(tempfile.mkdtemp(prefix="tdeploy-out-")) if self.remote else Path(local_path(url))
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, IO[str]] = {}

    def write_ranks(self, ranks: Ranks) -> None:
        """ranks.json, with the format version."""
        self._write_json(RANKS, asdict(ranks) | {"format_version": FORMAT_VERSION})

    def append_metrics(self, record: StepRecord) -> None:
        """One step's metrics of the record's rank."""
        self._append(f"{METRICS_DIR}/{rank_file(record.rank)}", record.to_json())

    def append_samples(self, rank: int, record: dict[str, Any]) -> None:
        """One step's sample indices of `rank`."""
        self._append(f"{SAMPLES_DIR}/{rank_file(rank)}", record)

    def append_epoch(self, record: EpochEnd) -> None:
        """An epoch that ended (rank 0)."""
        self._append(EPOCHS, asdict(record))

    def append_eval(self, record: dict[str, Any]) -> None:
        """One evaluation (step, val_loss, val_ppl)."""
        self._append(EVALS, record)

    def append_checkpoint(self, event: CheckpointEvent) -> None:
        """One save, committed or lost."""
        self._append(CHECKPOINTS, {k: v for k, v in asdict(event).items() if v is not None})

    def append_attempt(self, record: AttemptRecord) -> None:
        """A start of the trainer (rank 0)."""
        self._append(ATTEMPTS, asdict(record))

    def write_resume(self, record: ResumeRecord) -> None:
        """resume.json."""
        self._write_json(RESUME, asdict(record))

    def write_result(self, result: RunResult) -> None:
        """result.json."""
        self._write_json(RESULT, asdict(result))

    def write_distillation(self, record: DistillationRecord) -> None:
        """distillation.json (rank 0 of a distill run)."""
        self._write_json(DISTILLATION, asdict(record))

    def write_params(self, record: ParamRecord) -> None:
        """params/rank-NNNNN.json of the record's rank."""
        self._write_json(f"{PARAMS_DIR}/rank-{record.rank:05d}.json", asdict(record))

    def _append(self, name: str, record: dict[str, Any]) -> None:
        handle = self._files.get(name)
        if handle is None:
            path = self.dir / name
            path.parent.mkdir(parents=True, exist_ok=True)
            # Line-buffered: watchers (stall detection, drills) see every step as it happens.
            handle = self._files[name] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        handle.write(json.dumps(record) + "\n")

    def _write_json(self, name: str, data: Any) -> None:
        path = self.dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2))
        os.replace(tmp, path)

    def sync(self) -> None:
        """Flush files; upload them when the output URL is remote."""
        for handle in self._files.values():
            handle.flush()
        if self.remote:
            fs, root = filesystem(self.url, self.storage)
            for path in self.dir.rglob("*"):
                if path.is_file() and not path.name.startswith("."):
                    fs.put_file(str(path), join(root, str(path.relative_to(self.dir))))

    def close(self) -> None:
        """Flush, upload and close."""
        self.sync()
        for handle in self._files.values():
            handle.close()
        self._files.clear()


# ---- reader -----------------------------------------------------------------------------------


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """JSON lines of a file ([] when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _read_json(path: Path) -> Any:
    """A small JSON record of the run: a regular file of at most a few MiB (RunOutputFormatError otherwise)."""
    try:
        raw = read_control_file(LocalFileSystem(), str(path))
    except ControlFileError as err:
        raise RunOutputFormatError(path, err.problem, "remove it: the job writes this file, nothing else") from err
    return json.loads(raw)


def latest_by_step(records: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """One record per step; when a step ran again after a resume, the later attempt wins."""
    return {r["step"]: r for r in records}


class RunOutput:
    """A run's output folder as its readers see it (a local folder, possibly still being written)."""

    def __init__(self, output_dir: str | Path) -> None:
        self.dir = Path(local_path(str(output_dir)))

    def __repr__(self) -> str:
        return f"RunOutput({str(self.dir)!r})"

    @property
    def train_log(self) -> Path:
        """Where the launcher writes the job's log."""
        return self.dir / TRAIN_LOG

    def _json(self, name: str) -> Any | None:
        try:
            return _read_json(self.dir / name)
        except FileNotFoundError:
            return None

    def ranks(self) -> Ranks | None:
        """ranks.json (None before it is written); a newer format than this reader's is refused."""
        data = self._json(RANKS)
        if data is None:
            return None
        version = data.get("format_version", FORMAT_VERSION)  # runs from before the version was written: 1
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise RunOutputFormatError(
                self.dir / RANKS,
                f"format_version={version!r}, this reader knows versions up to {FORMAT_VERSION}",
                "read it with the transformer-deploy version that wrote it, or upgrade this one",
            )
        ranks = data.get("ranks")
        if not isinstance(ranks, list) or any(not isinstance(r, dict) for r in ranks):
            raise RunOutputFormatError(self.dir / RANKS, "ranks is not a list of rank records",
                                       "the trainer writes it; remove the file and run the job again")  # fmt: skip
        bad = [r for r in ranks if "pid" in r and not _sound_pid(r["pid"])]
        if bad:
            # Drills and cancels signal these pids: 0, -1 or a negative pid would signal a whole process group or
            # every process the user may signal.
            raise RunOutputFormatError(
                self.dir / RANKS,
                f"rank record pid={bad[0].get('pid')!r} is not a process id (an integer above 1)",
                "the trainer writes real pids; the file was altered: remove it and run the job again",
            )
        return Ranks(world_size=data["world_size"], ranks=ranks, format_version=version)

    def ranks_written_at(self) -> float | None:
        """When ranks.json was last written (unix seconds; None before it is)."""
        path = self.dir / RANKS
        return path.stat().st_mtime if path.exists() else None

    def metric_ranks(self) -> list[int]:
        """The ranks that recorded metrics, ascending."""
        return self._ranks_in(METRICS_DIR)

    def sample_ranks(self) -> list[int]:
        """The ranks that recorded samples, ascending."""
        return self._ranks_in(SAMPLES_DIR)

    def _ranks_in(self, folder: str) -> list[int]:
        return sorted(int(p.stem.split("-")[1]) for p in (self.dir / folder).glob("rank-*.jsonl"))

    def metric_records(self, rank: int = 0) -> list[StepRecord]:
        """Every metrics line of `rank` in order, repeated steps included."""
        path = self.dir / METRICS_DIR / rank_file(rank)
        records = []
        for number, line in enumerate(read_jsonl(path), start=1):
            try:
                records.append(StepRecord.from_json(line))
            except TypeError as err:
                raise RunOutputFormatError(
                    path, f"line {number} is not a step record ({err})", "remove it: the trainer writes this file"
                ) from err
        return records

    def metrics(self, rank: int = 0) -> dict[int, StepRecord]:
        """step -> metrics record of `rank` (later attempts win)."""
        return {r.step: r for r in self.metric_records(rank)}

    def all_metrics(self) -> dict[int, dict[int, StepRecord]]:
        """rank -> step -> metrics record, for every rank that recorded metrics."""
        return {rank: self.metrics(rank) for rank in self.metric_ranks()}

    def samples(self, rank: int = 0) -> dict[int, dict[str, Any]]:
        """step -> sample record of `rank` (later attempts win)."""
        return latest_by_step(read_jsonl(self.dir / SAMPLES_DIR / rank_file(rank)))

    def all_samples(self) -> dict[int, dict[int, dict[str, Any]]]:
        """rank -> step -> sample record, for every rank that recorded samples."""
        return {rank: self.samples(rank) for rank in self.sample_ranks()}

    def sample_records(self, rank: int = 0) -> list[dict[str, Any]]:
        """Every sample line of `rank` in order: each attempt's records, steps that ran again included."""
        return read_jsonl(self.dir / SAMPLES_DIR / rank_file(rank))

    def all_sample_records(self) -> dict[int, list[dict[str, Any]]]:
        """rank -> every sample line in order, for every rank that recorded samples."""
        return {rank: self.sample_records(rank) for rank in self.sample_ranks()}

    def epochs(self) -> list[EpochEnd]:
        """Every epoch end in order (an epoch that ended again after a resume appears again)."""
        return [EpochEnd(**r) for r in read_jsonl(self.dir / EPOCHS)]

    def last_step(self, rank: int = 0) -> int:
        """The last step `rank` has recorded (0 before the first); reads only the file's tail."""
        path = self.dir / METRICS_DIR / rank_file(rank)
        if not path.exists():
            return 0
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 4096))
            lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.startswith("{")]
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
        return 0

    def evals(self) -> list[dict[str, Any]]:
        """Every evaluation in order (step, val_loss, val_ppl)."""
        return read_jsonl(self.dir / EVALS)

    def checkpoints(self) -> list[CheckpointEvent]:
        """Every save in order, committed or lost."""
        return [CheckpointEvent(**r) for r in read_jsonl(self.dir / CHECKPOINTS)]

    def attempts(self) -> list[AttemptRecord]:
        """Every start of the trainer in order ([] for runs from before attempts.jsonl)."""
        path = self.dir / ATTEMPTS
        records = []
        for number, line in enumerate(read_jsonl(path), start=1):
            try:
                records.append(AttemptRecord(**line))
            except TypeError as err:
                raise RunOutputFormatError(
                    path, f"line {number} is not an attempt record ({err})", "remove it: the trainer writes this file"
                ) from err
        return records

    def resume(self) -> ResumeRecord | None:
        """What the last start-up loaded and skipped (None: it never looked, e.g. checkpoint.resume=false)."""
        data = self._json(RESUME)
        return None if data is None else ResumeRecord.from_json(data)

    def params(self) -> dict[int, ParamRecord]:
        """rank -> what it held at the end of the run ({} before the end, or from runs that did not record it)."""
        paths = (self.dir / PARAMS_DIR).glob("rank-*.json")
        records = [ParamRecord.from_json(_read_json(p)) for p in paths]
        return {r.rank: r for r in sorted(records, key=lambda r: r.rank)}

    def result(self) -> RunResult | None:
        """result.json (None until the job finished)."""
        data = self._json(RESULT)
        return None if data is None else RunResult(**data)

    def distillation(self) -> DistillationRecord | None:
        """distillation.json (None: not a distill run, or not finished)."""
        data = self._json(DISTILLATION)
        return None if data is None else DistillationRecord.from_json(data)


def _sound_pid(pid: Any) -> bool:
    """A value safe to signal as one process: an int above 1 (not a bool)."""
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 1
