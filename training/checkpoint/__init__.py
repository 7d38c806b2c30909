"""Distributed checkpoints with torch.distributed.checkpoint on any fsspec URL.

Layout of one checkpoint::

    <url>/step-00000040/.metadata, __<rank>_<n>.distcp   model + optimizer (DCP, sharded)
    <url>/step-00000040/train_state.json                 step, sampler position, LR scheduler, loss scaler
    <url>/step-00000040/rng/rank-00000.json              per-rank python/numpy/torch RNG states
    <url>/step-00000040/model.json                       the model card: architecture, tokenizer, dataset (ModelCard)
    <url>/step-00000040/COMMIT.json                      written last: file list with sha256 (+ hmac_sha256)

A checkpoint exists only once COMMIT.json is there. On local disks every file of
the save and its folders are fsynced before COMMIT.json is written (and its name
after), so a commit never names data still in the page cache; the writer then
reads COMMIT.json back, and a record that does not list every file written (with
its size and sha256) is withdrawn and the save fails (CheckpointCommitError).
Loading takes the newest
committed checkpoint whose files all match their checksums; a partial or
corrupt one is skipped with a warning that names it. Model and optimizer state
load under another world size (DCP reshards); per-rank RNG states then cannot
apply and are re-seeded, which the loader says.

Checksums are taken as the files are written (each writer thread hashes its own
file on the way to storage, so nothing is read back), and verified before a load
by every rank for its share of the files, several files at a time.

`save` returns once the checkpoint is committed. `save_async` returns once the
state is copied to host memory (DCP's stager: pinned buffers on GPUs, kept for
the next save) and writes, checksums and commits it in a background thread, on a
gloo process group of its own so that training's collectives go on meanwhile;
`wait` returns it, or raises its failure. The protocol is the same: until its
COMMIT.json is written the checkpoint is partial, so a process that dies in the
middle leaves the previous one the newest. A save (of either kind) waits for a
background one still in flight before it starts.

Trust (trust.py): DCP's pickles are read with an allow-list,
so a planted file cannot run code; with TDEPLOY_CHECKPOINT_KEY set, COMMIT.json
is signed (`hmac_sha256`) and only checkpoints signed with that key are loaded.
train_state.json and the RNG files are checked before anything is applied; one
that is not what this module writes raises CheckpointFormatError naming it.

Save failures: only storage and network errors (OSError, ENOSPC included, and
connection errors by name) are retried; any other exception inside a save is a
bug and is raised at once, on every rank (CheckpointAbortedError on the ranks
where it did not happen). When a local disk is short of the checkpoint's
estimated size, partial and old committed checkpoints are removed first (the
newest committed one is kept); a save that still cannot fit fails with
"no space left on <path>: checkpoint needs ~X MB, Y MB free", and the partial
folder of the last failed attempt is removed.

The modules: files.py (names in a step folder), commit.py (the COMMIT.json
record; copy_step and commit_digest, which the ledger and rollback use),
store.py (reading a checkpoint folder in one process), manager.py (collective
save, verification, resume, retention), writer.py (DCP's writer hashing as it
writes), collective.py (how ranks agree on a failure), space.py (size
estimates), errors.py, card.py (model.json), rng.py, trust.py (allow-list
readers, signed commits), memory.py (the in-memory tier: host-memory copies of
every rank's state, one kept on a peer's node, restored before storage).
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from training.checkpoint.card import CardTokenizer, ModelCard
    from training.checkpoint.commit import commit_digest, copy_step
    from training.checkpoint.errors import (
        CheckpointAbortedError,
        CheckpointCommitError,
        CheckpointCopyError,
        CheckpointFormatError,
        CheckpointSaveError,
        is_storage_error,
    )
    from training.checkpoint.files import COMMIT, DCP_METADATA, MODEL_CARD, TRAIN_STATE, rng_file, step_dir_name
    from training.checkpoint.manager import CheckpointManager, Restored
    from training.checkpoint.rng import capture_rng, restore_rng
    from training.checkpoint.store import CheckpointStore, TensorInfo
    from training.checkpoint.trust import (
        KEY_ENV,
        SIGNATURE_FIELD,
        CheckpointKeyError,
        UnsafeCheckpointError,
        checkpoint_key,
        sign_commit,
    )
    from training.checkpoint.writer import SavedCheckpoint

# Each name's submodule, imported on first use: the light ones (card, files, commit records, memory_auto) are read
# by the planner and the CLI, which must not pay for torch and DCP that the manager, store and writer import.
_HOMES = {
    "card": ("CardTokenizer", "ModelCard"),
    "commit": ("commit_digest", "copy_step"),
    "errors": ("CheckpointAbortedError", "CheckpointCommitError", "CheckpointCopyError", "CheckpointFormatError",
               "CheckpointSaveError", "is_storage_error"),
    "files": ("COMMIT", "DCP_METADATA", "MODEL_CARD", "TRAIN_STATE", "rng_file", "step_dir_name"),
    "manager": ("CheckpointManager", "Restored"),
    "rng": ("capture_rng", "restore_rng"),
    "store": ("CheckpointStore", "TensorInfo"),
    "trust": ("KEY_ENV", "SIGNATURE_FIELD", "CheckpointKeyError", "UnsafeCheckpointError", "checkpoint_key",
              "sign_commit"),
    "writer": ("SavedCheckpoint",),
}  # fmt: skip
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name: str) -> object:
    if name not in _HOME_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_HOME_OF[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "COMMIT",
    "DCP_METADATA",
    "KEY_ENV",
    "MODEL_CARD",
    "SIGNATURE_FIELD",
    "TRAIN_STATE",
    "CardTokenizer",
    "CheckpointAbortedError",
    "CheckpointCommitError",
    "CheckpointCopyError",
    "CheckpointFormatError",
    "CheckpointKeyError",
    "CheckpointManager",
    "CheckpointSaveError",
    "CheckpointStore",
    "ModelCard",
    "Restored",
    "SavedCheckpoint",
    "TensorInfo",
    "UnsafeCheckpointError",
    "capture_rng",
    "checkpoint_key",
    "commit_digest",
    "copy_step",
    "is_storage_error",
    "restore_rng",
    "rng_file",
    "sign_commit",
    "step_dir_name",
]
