"""The export step: a checkpoint (the newest sound one, or a given step) as a Hugging Face model folder.

The folder holds config.json, generation_config.json, model.safetensors (or model-0000k-of-0000n.safetensors
and model.safetensors.index.json), tokenizer.json, tokenizer_config.json and, written last, EXPORT.json: the
source checkpoint, its step, the model card, notes and the sha256 of every other file. A local folder is
written as `.partial-<name>-*` beside it and renamed when complete; an object-store URL gets every file
uploaded before EXPORT.json. Either way a folder without EXPORT.json is not a finished export.

A ViT classifier (model.kind vit) becomes a ViTForImageClassification folder instead: config.json,
preprocessor_config.json, the safetensors and README.md (tasks/export/vit.py), under the same staging, parity
check and EXPORT.json commit; a vision-language model (vlm) a LlavaForConditionalGeneration folder with its
processor and tokenizer (tasks/export/vlm.py).

The checkpoint is read only once `CheckpointManager.sound` has checked it (COMMIT.json, the signature when
TDEPLOY_CHECKPOINT_KEY is set, every checksum), through the allow-list readers of training/checkpoint/trust.py;
object-store checkpoints are read in place with the spec's storage options.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from tasks.errors import NoSpaceError, TransientError, UserError, is_connection_error
from tasks.export import vit, vlm
from tasks.export.hf import (
    CONFIG,
    DEFAULT_MAX_SHARD_BYTES,
    ExportError,
    behaviour_notes,
    byte_tokenizer_json,
    export_model_weights,
    unexportable,
    write_configs,
    write_tokenizer,
)
from tasks.export.parity import ExportParity, check_export, parity_prompts, require_parity
from tasks.export.readme import AcceptanceFigures, ReadmeFacts, write_readme
from tasks.paths import EXPORT_RECORD, DeploymentPaths, default_export_root
from tasks.prepare.tokenizer import read_tokenizer
from tasks.results import StepResult
from training.checkpoint import CardTokenizer, CheckpointManager, ModelCard
from training.config import TrainConfig
from training.dataset import read_manifest
from training.run_output import SkippedCheckpoint
from training.storage import check_storage_url, filesystem, free_bytes, is_local, is_no_space, join, local_path

if TYPE_CHECKING:
    from tasks.spec import DeploymentSpec

log = logging.getLogger(__name__)

EXPORT_VERSION = 1
PARTIAL_PREFIX = ".partial-"
TITLE = "export"
ARTIFACT = "export"


class ExportInputs(BaseModel):
    """What the export step reads: the training config whose checkpoint is exported, which step, where to."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    train: TrainConfig
    step: int | None = None
    """The checkpoint step to export (None: the newest sound one)."""
    out: str | None = None
    """The model folder to write (a local path or an object-store URL); None: <export_root>/step-<N>."""
    export_root: str | None = None
    """The folder exports go under (tasks.paths: <deployment_dir>/export)."""
    tokenizer_url: str | None = None
    """The tokenizer.json of a run trained on adopted ids without one."""
    acceptance: AcceptanceFigures | None = None
    """The acceptance figures the model card shows (the flow and the CLI pass the deployment's latest)."""

    @classmethod
    def of(
        cls,
        spec: DeploymentSpec,
        train: TrainConfig,
        step: int | None = None,
        out: str | None = None,
        tokenizer_url: str | None = None,
        acceptance: AcceptanceFigures | None = None,
    ) -> ExportInputs:
        """The export of `spec`'s checkpoint (`train`: data_and_training's) under its deployment's export folder."""
        export_root = DeploymentPaths.of(spec).export_dir
        return cls(train=train, step=step, out=out, export_root=export_root, tokenizer_url=tokenizer_url,
                   acceptance=acceptance)  # fmt: skip


class ExportResult(StepResult):
    """A checkpoint exported as a Hugging Face model folder."""

    model_dir: str
    step: int
    checkpoint_dir: str
    """The source checkpoint's step folder (a path, or a URL on an object store)."""
    n_params: int
    files: list[str]
    bytes: int
    """Bytes of every file written, EXPORT.json included."""
    architecture: str
    notes: list[str] = []
    """Where the exported model computes something other than the run (an MoE capacity factor, say)."""
    serving_dtype: str = "float32"
    """The dtype to serve the folder in (config.json torch_dtype): the one the run trained in."""
    parity: ExportParity | None = None
    """The load-time check: transformers' logits of the folder against the checkpoint's."""

    def summary(self) -> str:
        """Step, architecture, size and where the folder is."""
        notes = f"; {len(self.notes)} note(s) in EXPORT.json" if self.notes else ""
        parity = (
            f"; transformers' logits within {self.parity.max_abs_logit_diff:.2g} of the checkpoint's "
            f"(tolerance {self.parity.tolerance:.2g}); serve in {self.serving_dtype}"
            if self.parity is not None
            else ""
        )
        return (
            f"step {self.step} as {self.architecture}: {self.n_params / 1e6:.2f}M params, {len(self.files)} files, "
            f"{self.bytes / 1e6:.1f} MB in `{self.model_dir}`{notes}{parity}"
        )


def step_folder_name(step: int) -> str:
    """The default folder of the export of `step` under an export root."""
    return f"step-{step}"


def _select(manager: CheckpointManager, step: int | None) -> tuple[int, dict[str, Any]]:
    """The step to export and its verified commit record; UserError naming the folder, the step and the others."""
    url = manager.cfg.url
    steps = manager.steps_on_storage()
    if not steps:
        raise UserError(
            f"checkpoint.url={url}: no checkpoint there (no step-NNNNNNNN folder)",
            "train first (tdeploy train SPEC), or point checkpoint.url at the run's checkpoint folder",
        )
    committed = manager.committed_steps()
    listed = ", ".join(map(str, committed)) or "none"
    skipped: list[SkippedCheckpoint] = []
    if step is None:
        found = manager.latest_sound(skipped)
        if found is None:
            reasons = "; ".join(f"step {s.step} {s.reason}: {s.detail}" for s in skipped)
            raise UserError(
                f"checkpoint.url={url}: no sound checkpoint ({reasons})",
                "resume the run so that it saves a complete checkpoint, or restore one",
            )
        return found
    if step not in steps:
        raise UserError(
            f"step={step}: no checkpoint of that step under {url} (committed steps: {listed})",
            "pass one of the committed steps, or leave the step out to export the newest sound one",
        )
    commit = manager.sound(step, skipped)
    if commit is None:
        others = ", ".join(str(s) for s in committed if s != step) or "none"
        raise UserError(
            f"step={step}: the checkpoint {manager.step_url(step)} cannot be used: {skipped[0].detail}",
            f"export another step (committed: {others}), or leave the step out for the newest sound one",
        )
    return step, commit


def _card(
    manager: CheckpointManager, step: int, commit: dict[str, Any], train: TrainConfig
) -> tuple[ModelCard, list[str]]:
    """The checkpoint's model card; for one saved before cards existed, the spec's model on its dataset."""
    card = manager.read_card(step, commit)
    if card is not None:
        return card, []
    if train.model.kind != "lm":
        raise ExportError(
            "model.json",
            None,
            f"checkpoint step {step} of a model.kind={train.model.kind} run has no model card, which names the "
            "dataset its labels come from",
            "export a checkpoint this trainer saved (it writes model.json beside every checkpoint)",
        )
    card = ModelCard.of_run(train, read_manifest(train.data.dataset_url, train.storage, train.data.sources))
    note = (
        f"checkpoint step {step} has no model.json (saved before model cards): the architecture is the spec's "
        f"model section and the tokenizer that of {train.data.dataset_url}"
    )
    return card, [note]


def _with_tokenizer(card: ModelCard, tokenizer_url: str | None, step: int, train: TrainConfig) -> ModelCard:
    """The card with the tokenizer to ship: the dataset's, or `tokenizer_url` for a run on adopted ids without one.

    A run on adopted token ids with no tokenizer named (data.tokenizer_url unset) is refused before anything is
    written: a model folder without a tokenizer loads in neither transformers' pipelines nor vLLM.
    """
    if tokenizer_url is None:
        if card.tokenizer.kind == "unknown":
            raise ExportError(
                "model.json tokenizer.kind",
                "unknown",
                f"checkpoint step {step} was trained on adopted token ids ({card.dataset_url}) and no tokenizer was "
                "named for them (data.tokenizer_url was unset)",
                "export with --tokenizer URL (the export_model task's tokenizer_url) naming the tokenizer.json that "
                "made the ids; set data.tokenizer_url for later runs",
            )
        return card
    if card.tokenizer.kind != "unknown":
        raise ExportError(
            "--tokenizer",
            tokenizer_url,
            f"checkpoint step {step} was trained with its dataset's own tokenizer ({card.tokenizer.kind}), which the "
            "export ships",
            "leave --tokenizer out",
        )
    try:
        check_storage_url(tokenizer_url)
    except ValueError as err:
        raise ExportError("--tokenizer", tokenizer_url, str(err), "give a path or URL of a tokenizer.json") from err
    tokenizer = read_tokenizer(tokenizer_url, train.storage, "--tokenizer")
    if tokenizer.vocab_size > card.model.vocab_size:
        raise ExportError(
            "--tokenizer",
            tokenizer_url,
            f"the tokenizer has {tokenizer.vocab_size} tokens, more than the model's vocab_size="
            f"{card.model.vocab_size}: it did not make the ids this model was trained on",
            "name the tokenizer.json that made the adopted ids",
        )
    return card.model_copy(update={"tokenizer": CardTokenizer(kind="bpe", url=tokenizer_url, sha256=tokenizer.sha256)})


def _check_target(final: Path) -> None:
    """Refuse to replace a folder that is not an earlier export (its EXPORT.json) and holds anything."""
    if final.exists() and (not final.is_dir() or (any(final.iterdir()) and not (final / EXPORT_RECORD).exists())):
        raise UserError(
            f"out={final}: exists and is not an export (no {EXPORT_RECORD}); an export replaces only an earlier one",
            "remove it, or choose another output folder",
        )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class _Written:
    """The model files of an export, checked by loading them back: what the card and EXPORT.json state."""

    files: list[str]
    architecture: str
    n_params: int
    parity: ExportParity


def _write_lm(
    manager: CheckpointManager, step: int, card: ModelCard, train: TrainConfig, folder: Path, max_shard_bytes: int,
    dtype: str,
) -> _Written:  # fmt: skip
    """A language model as LlamaForCausalLM / MixtralForCausalLM with its tokenizer, loaded back."""
    files = write_configs(card, folder, dtype)
    weights = export_model_weights(manager, step, card.model, folder, max_shard_bytes)
    files += weights.files
    files += write_tokenizer(card, train.storage, folder)
    config = json.loads((folder / CONFIG).read_text())
    parity = _load_back(manager, step, card, train, folder)
    return _Written(files, config["architectures"][0], weights.n_params, parity)


def _write_vit(
    manager: CheckpointManager, step: int, card: ModelCard, train: TrainConfig, folder: Path, max_shard_bytes: int,
    dtype: str, class_names: list[str],
) -> _Written:  # fmt: skip
    """A ViT classifier as ViTForImageClassification with its image processor (tasks/export/vit.py), loaded back
    on held-out images of its dataset."""
    vision = vit.check_exportable(card.model)
    files = vit.write_vit_configs(card.model, class_names, folder, dtype)
    weights = vit.export_vit_weights(manager, step, vision, folder, max_shard_bytes)
    files += weights.files
    data = train.data
    images, source = vit.parity_images(card.dataset_url, train.storage, data.val_split, data.train_split, vision)
    parity = vit.load_back(manager, step, card.model, class_names, folder, images, source)
    log.info(
        "export parity of step %d: max |logit diff| %.3g (tolerance %.3g) on %d images from %s",
        step, parity.max_abs_logit_diff, parity.tolerance, parity.prompts, parity.prompts_from,
    )  # fmt: skip
    return _Written(files, vit.ARCHITECTURE, weights.n_params, parity)


def _write_vlm(
    manager: CheckpointManager, step: int, card: ModelCard, train: TrainConfig, folder: Path, max_shard_bytes: int,
    dtype: str,
) -> _Written:  # fmt: skip
    """A vision-language model as LlavaForConditionalGeneration with its processor and tokenizer
    (tasks/export/vlm.py), loaded back on held-out images and captions of its dataset."""
    files = vlm.write_vlm_configs(card, folder, dtype)
    weights = vlm.export_vlm_weights(manager, step, card.model, folder, max_shard_bytes)
    files += weights.files + vlm.write_vlm_tokenizer(card, train.storage, folder)
    data = train.data
    images, captions, source = vlm.parity_samples(
        card.dataset_url, train.storage, data.val_split, data.train_split, card.model, card.vocab_size
    )
    parity = vlm.load_back(manager, step, card, folder, images, captions, source)
    log.info(
        "export parity of step %d: max |logit diff| %.3g (tolerance %.3g) on %d images with captions from %s",
        step, parity.max_abs_logit_diff, parity.tolerance, parity.prompts, parity.prompts_from,
    )  # fmt: skip
    return _Written(files, vlm.ARCHITECTURE, weights.n_params, parity)


def _write_folder(
    manager: CheckpointManager,
    step: int,
    commit: dict[str, Any],
    card: ModelCard,
    notes: list[str],
    train: TrainConfig,
    folder: Path,
    max_shard_bytes: int,
    acceptance: AcceptanceFigures | None = None,
    class_names: list[str] | None = None,
) -> dict[str, Any]:
    """Every file of the export into `folder`, then the load-back check (ExportParityError when the folder does
    not reproduce the checkpoint), EXPORT.json last; returns EXPORT.json's content. `class_names`: a
    classifier's labels."""
    dtype = train.precision.torch_name  # served in what the run's forward (and evaluations) ran in
    if card.model.kind == "vit":
        written = _write_vit(manager, step, card, train, folder, max_shard_bytes, dtype, class_names or [])
    elif card.model.kind == "vlm":
        written = _write_vlm(manager, step, card, train, folder, max_shard_bytes, dtype)
    else:
        written = _write_lm(manager, step, card, train, folder, max_shard_bytes, dtype)
    files, parity = written.files, written.parity
    facts = ReadmeFacts(
        step=step, checkpoint_url=manager.step_url(step), architecture=written.architecture,
        n_params=written.n_params, serving_dtype=dtype, parity=parity, base_model=card.model.init_from,
        acceptance=acceptance, notes=notes, class_names=class_names or [],
    )  # fmt: skip
    files += write_readme(card, facts, folder)
    record = {
        "format_version": EXPORT_VERSION,
        "source": {
            "checkpoint_url": manager.step_url(step),
            "step": step,
            "commit_created_unix_s": commit.get("created_unix_s"),
            "commit_sha256": hashlib.sha256(json.dumps(commit, sort_keys=True).encode()).hexdigest(),
        },
        "architecture": written.architecture,
        "n_params": written.n_params,
        "serving_dtype": dtype,
        "parity": parity.model_dump(mode="json"),
        "card": card.model_dump(mode="json"),
        "notes": notes,
        "exported_unix_s": time.time(),
        "files": {name: {"sha256": _sha256(folder / name), "bytes": (folder / name).stat().st_size} for name in files},
    }
    (folder / EXPORT_RECORD).write_text(_record_text(record))
    share_modes(folder)
    return record


def _load_back(
    manager: CheckpointManager, step: int, card: ModelCard, train: TrainConfig, folder: Path
) -> ExportParity:
    """The written `folder` loaded by transformers against checkpoint `step` (tasks/export/parity.py);
    ExportParityError, naming the largest-deviating tensor, when it does not reproduce the checkpoint."""
    from training.model import Transformer

    ours = Transformer(card.model)
    manager.load_model(step, ours)
    prompts, source = parity_prompts(train, card.vocab_size, card.model.seq_len)
    parity = check_export(folder, ours.eval(), prompts, source)
    del ours
    require_parity(parity, f"checkpoint step {step}")
    log.info(
        "export parity of step %d: max |logit diff| %.3g (tolerance %.3g) on %d prompts from %s",
        step, parity.max_abs_logit_diff, parity.tolerance, parity.prompts, parity.prompts_from,
    )  # fmt: skip
    return parity


def _umask() -> int:
    """This process's umask (read without changing it where /proc says it)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def share_modes(folder: Path) -> None:
    """Files 0666 and the folder 0777, less the umask (0644 / 0755 under the usual 022): a serving pod that runs
    as another user reads the folder on shared storage (mkdtemp makes 0700)."""
    mask = _umask()
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
    folder.chmod(0o777 & ~mask)


def _record_text(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2)


def _replace(partial: Path, final: Path) -> None:
    """Put the finished `partial` folder in place of `final` (an earlier export there goes)."""
    _check_target(final)
    if not final.exists():
        partial.rename(final)
        return
    old = final.with_name(f"{PARTIAL_PREFIX}old-{final.name}-{time.time_ns()}")
    final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)


_SMALL_FILES_BYTES = 64 << 10
"""Room for config.json, generation_config.json, tokenizer_config.json, the index and EXPORT.json (a few kB)."""
_HEADER_BYTES_PER_TENSOR = 256  # a safetensors header entry: name, dtype, shape, offsets


def _needed_bytes(manager: CheckpointManager, step: int, card: ModelCard, train: TrainConfig) -> int:
    """About what an export of `step` writes: its tensors with their headers, the tokenizer, the small files."""
    tensors = manager.model_tensors(step).values()
    needed = sum(info.nbytes + _HEADER_BYTES_PER_TENSOR for info in tensors) + _SMALL_FILES_BYTES
    if card.model.kind != "lm":
        return needed
    if card.tokenizer.kind == "bytes":
        return needed + len(byte_tokenizer_json().encode())
    if card.tokenizer.url is not None:
        fs, path = filesystem(card.tokenizer.url, train.storage)
        with contextlib.suppress(FileNotFoundError):  # write_tokenizer refuses it, with the fix
            needed += int(fs.size(path) or 0)
    return needed


def _no_space(where: str, needed: int, fix: str) -> NoSpaceError:
    return NoSpaceError(where, "the export", needed, free_bytes(where), fix)


def _upload(folder: Path, url: str, train: TrainConfig) -> None:
    """Upload a finished export to an object-store `url`, EXPORT.json last (an earlier one's removed first)."""
    fs, root = filesystem(url, train.storage)
    record = join(root, EXPORT_RECORD)
    if fs.exists(record):
        fs.rm(record)
    for path in sorted(folder.iterdir()):
        if path.name != EXPORT_RECORD:
            fs.put_file(str(path), join(root, path.name))
    fs.put_file(str(folder / EXPORT_RECORD), record)


def export_checkpoint(
    train: TrainConfig,
    step: int | None = None,
    out: str | Path | None = None,
    *,
    export_root: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    tokenizer_url: str | None = None,
    acceptance: AcceptanceFigures | None = None,
) -> ExportResult:
    """Export checkpoint `step` (None: the newest sound one) of `train`'s checkpoint folder to `out`.

    `out` is the model folder (a local path or an object-store URL); None = <export_root>/step-<N>, where
    export_root defaults to `export` beside checkpoint.url (callers with a spec pass DeploymentPaths.export_dir).
    `tokenizer_url`: the tokenizer.json of a run trained on adopted ids without one (see _with_tokenizer).
    `acceptance`: the run's acceptance figures (AcceptanceFigures.of a report), shown in the model card.
    """
    manager = CheckpointManager(train.checkpoint, train.storage)
    try:
        chosen, commit = _select(manager, step)
        card, notes = _card(manager, chosen, commit, train)
        class_names: list[str] | None = None
        if card.model.kind == "vlm":
            card = _with_tokenizer(card, tokenizer_url, chosen, train)
            vlm.check_exportable(card.model)
            vlm.image_token_id(card)  # room for <image> in the vocabulary: refused before a byte is written
        elif card.model.kind == "vit":
            if tokenizer_url is not None:
                raise ExportError("--tokenizer", tokenizer_url, "a ViT classifier has no tokenizer", "leave it out")
            vision = vit.check_exportable(card.model)
            assert vision.num_classes is not None
            class_names, label_notes = vit.class_names(card.dataset_url, train.storage, vision.num_classes)
            notes += label_notes
        else:
            card = _with_tokenizer(card, tokenizer_url, chosen, train)
            problems = unexportable(card.model)
            if problems:
                raise problems[0]
            notes += behaviour_notes(card)
        target = (
            str(out) if out is not None else join(export_root or default_export_root(train), step_folder_name(chosen))
        )
        # Written here first: the output folder (beside it), or a local temporary one uploaded from.
        staging = local_path(target) if is_local(target) else tempfile.gettempdir()
        fix = (
            "free space there or export to another folder (--out)"
            if is_local(target)
            else "free space there or set TMPDIR to a local folder with room (the export is written there first)"
        )
        needed = _needed_bytes(manager, chosen, card, train)
        try:
            if is_local(target):
                final = Path(staging)
                _check_target(final)
                final.parent.mkdir(parents=True, exist_ok=True)
                free = free_bytes(str(final.parent))
                if free is not None and free < needed:  # refused before a byte is written
                    raise _no_space(staging, needed, fix)
                partial = Path(tempfile.mkdtemp(prefix=f"{PARTIAL_PREFIX}{final.name}-", dir=final.parent))
                try:
                    record = _write_folder(
                        manager, chosen, commit, card, notes, train, partial, max_shard_bytes, acceptance, class_names
                    )
                    _replace(partial, final)
                finally:
                    shutil.rmtree(partial, ignore_errors=True)
                model_dir = str(final)
            else:
                with tempfile.TemporaryDirectory(prefix=f"{PARTIAL_PREFIX}export-") as tmp:
                    staging = tmp
                    record = _write_folder(
                        manager, chosen, commit, card, notes, train, Path(tmp), max_shard_bytes, acceptance,
                        class_names,
                    )
                    _upload(Path(tmp), target, train)
                model_dir = target
        except Exception as err:
            # ENOSPC, or safetensors' own error with the OS's text; the free space is what the disk has once the
            # partial folder is gone
            if is_no_space(err):
                raise _no_space(staging, needed, fix) from err
            raise
    except Exception as err:
        if is_connection_error(err) or (err.__cause__ is not None and is_connection_error(err.__cause__)):
            raise TransientError(
                f"export of {train.checkpoint.url}: storage unreachable: {err}", "run the export again"
            ) from err
        raise
    files = [*record["files"], EXPORT_RECORD]
    total = sum(entry["bytes"] for entry in record["files"].values()) + len(_record_text(record).encode())
    result = ExportResult(
        model_dir=model_dir,
        step=chosen,
        checkpoint_dir=record["source"]["checkpoint_url"],
        n_params=record["n_params"],
        files=files,
        bytes=total,
        architecture=record["architecture"],
        notes=notes,
        serving_dtype=record["serving_dtype"],
        parity=ExportParity.model_validate(record["parity"]),
    )
    log.info("exported %s", result.summary())
    for note in notes:
        log.warning("export of step %d: %s", chosen, note)
    return result


def run(inputs: ExportInputs) -> ExportResult:
    """Export the checkpoint `inputs` name (see `export_checkpoint`)."""
    return export_checkpoint(inputs.train, inputs.step, inputs.out, export_root=inputs.export_root,
                             tokenizer_url=inputs.tokenizer_url, acceptance=inputs.acceptance)  # fmt: skip
