"""The in-memory checkpoint tier: every `checkpoint.memory_every_steps` each rank keeps its state in host memory and
sends a copy to a peer rank on another node; a restarted job restores from these copies before it reads storage.

Layout, in a node-local folder on tmpfs (`checkpoint.memory_dir`, default /dev/shm/tdeploy-memory)::

    <memory_dir>/<job key>/node-<GROUP_RANK>/step-00000012/rank-00003.by-00001.pt    rank 3's state, kept by rank 1
    <memory_dir>/<job key>/node-<GROUP_RANK>/step-00000012/rank-00003.by-00001.json  its record, written last

The job key is derived from checkpoint.url (one job, one key); the folder per node is what makes a node's loss
lose its copies (on one machine acting several nodes out, /dev/shm is shared). A copy's bytes are
`torch.save({"flat", "hyper", "index", "meta"})`: the rank's local tensors (DTensors as their local shards)
concatenated into one buffer per dtype, the optimizer's hyper-parameters, the index of the buffers (JSON:
state-dict key, shape, offset), and "meta" (JSON: the train state, the RNG states, step, rank, world and layout).
Packing a few buffers instead of pickling hundreds of tensors keeps the copy cheap. The record is the commit:
sha256 and size of the bytes, step, rank, world size, layout, and `hmac_sha256` when TDEPLOY_CHECKPOINT_KEY is
set (trust.py); both are written to a temporary name and renamed, the record last. Each holder keeps its last 2
steps.

The peer ("buddy") of rank r is (r + local_world_size) % world, a rank of the next node (with one node: the next
local rank). The snapshot is taken on the training thread (a copy of every tensor); the exchange with the buddy
runs in a background thread over a gloo group of its own (training's collectives go on meanwhile on the default
group; the next snapshot waits for the previous exchange), and so do serialising, hashing and writing for copies of
at least BACKGROUND_MIN_BYTES (smaller ones are cheaper at the save point).

Restore (collective, at the trainer's start): the first rank of each node lists its node folder; the inventories
are gathered; every rank chooses the same newest step that is complete (`choose`): a copy of every saved rank's
state, or for a replicated data-parallel layout any replica's copy (a changed world is then fine; per-rank RNG
states are re-seeded as after a reshard). A sharded or model-parallel layout needs the same world and layout.
Memory is used only when its step is not older than the newest committed checkpoint on storage (a listing, no
data read; storage that cannot be listed does not stop the memory rung). Each rank's copy is sent by its holder
over the default group and checked by the receiver (sha256, signature, a weights-only unpickle): a copy that fails
is refused with its reason and the next holder is tried; when a rank has none left, the next older step, then
storage. Copies are untrusted input: `torch.load(weights_only=True)` only.

Why not a library: NVIDIA Resiliency Extension's local checkpoints (LocalCheckpointManager with a clique
replication strategy; 0.4.1 is the newest that installs here) take CUDA tensors only (BasicTensorAwareStateDict
asserts `is_cuda`), load a copy with `torch.load(weights_only=False)` and carry no digest or signature; DLRover's
flash checkpoint needs its own elastic agent in place of torchrun's; torchft heals a replica from a live peer
(rung 1), not after a restart of the whole group.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import io
import json
import logging
import math
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from training.checkpoint.collective import all_gather
from training.checkpoint.commit import parse_json
from training.checkpoint.errors import CheckpointFormatError
from training.checkpoint.files import step_dir_name
from training.checkpoint.memory_auto import KEPT_STEPS, StallWindow, TierDecision, available_bytes, fit
from training.checkpoint.rng import capture_rng, check_rng, restore_rng
from training.checkpoint.trust import CheckpointKeyError, checkpoint_key, sign_commit, untrusted_reason
from training.config import CheckpointConfig
from training.job_env import DEFAULT_MEMORY_DIR
from training.recovery_record import Refusal

log = logging.getLogger(__name__)

KEEP_STEPS = KEPT_STEPS
FORMAT = "tdeploy-memory-copy/1"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # the keys storage checkpoints use
_COPY = re.compile(r"rank-(\d{5})\.by-(\d{5})\.json$")
_STEP = re.compile(r"step-(\d{8})$")
_NODE = re.compile(r"node-\d{1,7}$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_RECORD_BYTES = 64 << 10
BACKGROUND_MIN_BYTES = 64 << 20
"""Copies of at least this size are serialised and written on a background thread; smaller ones at the save point
(the exchange with the peer is always in the background). Measured on the CPU tiny model (0.5 MB of state,
2 cores): a thread doing the pickling and hashing held each step ~7 ms through GIL hand-offs (5 ms switch
interval), more than the ~1.5 ms the work takes inline; large copies spend their time in memcpy, hashing and
file writes, which release the GIL."""


def job_key(checkpoint_url: str) -> str:
    """The folder name of one job's copies: derived from its checkpoint.url."""
    return hashlib.sha256(checkpoint_url.encode()).hexdigest()[:16]


def node_folder(cfg: CheckpointConfig, node: int) -> str:
    """Where node `node` (torchrun's GROUP_RANK) keeps its copies of the job of `cfg`."""
    return os.path.join(cfg.memory_dir or DEFAULT_MEMORY_DIR, job_key(cfg.url), f"node-{node}")


def buddy_of(rank: int, world: int, local_world: int) -> int:
    """The rank that keeps `rank`'s peer copy: the same local rank of the next node (one node: the next rank)."""
    step = local_world if world > local_world else 1
    return (rank + step) % world


def copy_name(rank: int, holder: int) -> str:
    """File stem of rank `rank`'s copy saved by rank `holder`."""
    return f"rank-{rank:05d}.by-{holder:05d}"


def check_record(value: Any, where: str) -> dict[str, Any]:
    """A copy's record as `MemoryTier` writes it, or CheckpointFormatError saying what is off."""
    if not isinstance(value, dict) or value.get("format") != FORMAT:
        raise CheckpointFormatError(where, f"is not a memory copy record (format {FORMAT})")
    for name in ("step", "rank", "world_size", "bytes"):
        number = value.get(name)
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise CheckpointFormatError(where, f"has {name}={number!r}; expected a non-negative integer")
    if value["world_size"] < 1 or value["rank"] >= value["world_size"]:
        raise CheckpointFormatError(where, f"has rank {value['rank']} of world {value['world_size']}")
    if not isinstance(value.get("sha256"), str) or not _SHA256.fullmatch(value["sha256"]):
        raise CheckpointFormatError(where, f"has sha256={value.get('sha256')!r}; expected 64 hex digits")
    layout = value.get("layout")
    if not isinstance(layout, str) or len(layout) > 200 or not isinstance(value.get("replicated"), bool):
        raise CheckpointFormatError(where, "has no layout string or replicated flag")
    return value


@dataclass(frozen=True)
class Offer:
    """A copy some rank can hand out now: rank `rank`'s state at `step`, held by rank `holder` (this attempt's)."""

    holder: int
    name: str
    record: dict[str, Any]

    @property
    def step(self) -> int:
        """The step the copy was taken after."""
        return int(self.record["step"])

    @property
    def rank(self) -> int:
        """The rank whose state it is."""
        return int(self.record["rank"])


@dataclass
class Plan:
    """Which copies restore which rank at `step`: candidates per target rank, best first."""

    step: int
    candidates: dict[int, list[Offer]]
    rng_restored: bool


def choose(
    offers: list[Offer],
    world: int,
    layout: str,
    replicated: bool,
    storage_step: int | None,
    refused: set[str] = frozenset(),  # type: ignore[assignment]
) -> tuple[list[Plan], str]:
    """The usable steps, newest first, each with its plan; when there are none, why (for the record).

    A step is usable when it is not older than `storage_step` and complete: the same world and layout with a copy
    of every saved rank (each rank restores its own rank's state and RNG), or, for a replicated layout under
    another world, any copy (each rank takes a replica's state; RNG re-seeded)."""
    by_step: dict[int, list[Offer]] = {}
    for offer in offers:
        if offer.name not in refused:
            by_step.setdefault(offer.step, []).append(offer)
    plans, reasons = [], []
    for step in sorted(by_step, reverse=True):
        if storage_step is not None and step < storage_step:
            reasons.append(f"step {step} is older than the checkpoint of step {storage_step} on storage")
            break
        here = by_step[step]
        saved_world, saved_layout = here[0].record["world_size"], here[0].record["layout"]
        here = [o for o in here if (o.record["world_size"], o.record["layout"]) == (saved_world, saved_layout)]
        same = saved_world == world and saved_layout == layout
        by_rank: dict[int, list[Offer]] = {}
        for offer in here:
            by_rank.setdefault(offer.rank, []).append(offer)
        missing = sorted(set(range(saved_world)) - set(by_rank))
        if same and not missing:
            plans.append(Plan(step, {t: _prefer(by_rank[t], t) for t in range(world)}, rng_restored=True))
        elif replicated and all(o.record["replicated"] for o in here) and saved_layout == layout:
            pool = sorted(here, key=lambda o: (o.rank, o.holder))
            plans.append(Plan(step, {t: _prefer(pool, t) for t in range(world)}, rng_restored=False))
        elif not same:
            reasons.append(
                f"step {step} was saved by {saved_world} ranks (layout {saved_layout or 'data parallel'}), this job "
                f"has {world} (layout {layout or 'data parallel'}): a sharded layout restores from memory only "
                "under the same world and layout"
            )
        else:
            lost = ", ".join(str(r) for r in missing[:8])
            reasons.append(f"step {step} is incomplete: no copy of rank {lost} survived")
    if not by_step:
        reasons.append("no copies in host memory")
    return plans, "; ".join(reasons)


def _prefer(offers: list[Offer], target: int) -> list[Offer]:
    """Candidates for `target`: its own rank's copies first (held by itself first: no transfer), then the rest."""
    return sorted(offers, key=lambda o: (o.rank != target, o.holder != target, o.holder, o.rank))


def verify_copy(
    data: bytes, record: dict[str, Any], key: bytes | None, where: str
) -> tuple[dict[str, Any] | None, str]:
    """The unpickled state of a received copy, or None and why it is refused: its size and sha256 against its record,
    the record's signature, a weights-only unpickle, and the step and rank inside against the record."""
    if len(data) != record["bytes"]:
        return None, f"holds {len(data)} bytes, its record says {record['bytes']}"
    if hashlib.sha256(data).hexdigest() != record["sha256"]:
        return None, "fails its sha256 check (the copy was altered or torn)"
    try:
        reason = untrusted_reason(record, key, where)
    except CheckpointKeyError as err:
        reason = err.problem
    if reason:
        return None, reason.replace("its COMMIT.json", "its record")
    try:
        state = torch.load(io.BytesIO(data), weights_only=True)
        meta = json.loads(state["meta"])
        if (meta["step"], meta["rank"]) != (record["step"], record["rank"]):
            return None, f"holds step {meta['step']} of rank {meta['rank']}, not what its record says"
        check_rng(meta["rng"], where)
        model_sd, optim_sd = unpack(state["flat"], state["hyper"], json.loads(state["index"]))
    except Exception as err:  # noqa: BLE001 - anything that is not the copy this tier writes is refused
        return None, f"is not a copy this trainer wrote: {type(err).__name__}: {str(err)[:200]}"
    return {"model": model_sd, "optim": optim_sd, "meta": meta}, ""


def unpack(
    flat: dict[str, torch.Tensor], hyper: dict[str, Any], index: list[list[Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model and optimizer state dicts of a copy: each indexed entry (section, key, dtype, shape, offset) a view
    of its dtype's flat buffer, the optimizer's hyper-parameters beside them. ValueError for an index that does
    not fit its buffers."""
    sections: dict[str, dict[str, Any]] = {"model": {}, "optim": {}}
    for section, key, dtype, shape, offset in index:
        buffer = flat[dtype]
        numel = math.prod(shape)
        if section not in sections or not isinstance(key, str) or offset < 0 or offset + numel > buffer.numel():
            raise ValueError(f"entry {key!r} lies outside its {dtype} buffer")
        sections[section][key] = buffer[offset : offset + numel].view(shape)
    sections["optim"].update(hyper)
    return sections["model"], sections["optim"]


class StateView:
    """This rank's model and optimizer tensors under their flattened state-dict keys (DCP's get_state_dict, taken
    once: parameters and the optimizer's state are updated in place), and where each optimizer hyper-parameter
    lives in `optimizer.param_groups` (the LR changes every step). `pack` copies them all in one pass per dtype."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        self.tensors = [
            (section, key, _local(value))
            for section, sd in (("model", model_sd), ("optim", optim_sd))
            for key, value in sd.items()
            if isinstance(value, torch.Tensor)
        ]
        group_of_ptr = {_local(p).data_ptr(): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        group_of_fqn = {k: group_of_ptr.get(_local(v).data_ptr()) for k, v in model_sd.items()}
        self.hyper: list[tuple[str, int, str]] = []
        self.exact = True  # every hyper-parameter found in param_groups (else get_state_dict each time)
        for key, value in optim_sd.items():
            if isinstance(value, torch.Tensor):
                continue
            fqn, _, name = key.removeprefix("param_groups.").rpartition(".")
            group = group_of_fqn.get(fqn)
            if not key.startswith("param_groups.") or group is None or name not in optimizer.param_groups[group]:
                self.exact = False
                break
            self.hyper.append((key, group, name))
        self.fingerprint = self._fingerprint()
        self.parts: dict[str, list[torch.Tensor]] = {}  # flat views of the live tensors, per dtype
        self.index: list[list[Any]] = []
        offsets: dict[str, int] = {}
        for section, key, tensor in self.tensors:
            dtype = str(tensor.dtype).removeprefix("torch.")
            self.exact = self.exact and tensor.is_contiguous()  # else reshape copies: no live view to keep
            self.parts.setdefault(dtype, []).append(tensor.detach().reshape(-1))
            self.index.append([section, key, dtype, list(tensor.shape), offsets.get(dtype, 0)])
            offsets[dtype] = offsets.get(dtype, 0) + tensor.numel()
        self.index_json = json.dumps(self.index)  # the same for every copy: serialised once
        self.nbytes = sum(t.numel() * t.element_size() for parts in self.parts.values() for t in parts)
        """Bytes of one packed copy of the tensors."""

    def _fingerprint(self) -> tuple[int, ...]:
        """The optimizer's state tensors by identity: a load replaces them, and the view is then taken again."""
        return tuple(id(v) for st in self.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor))

    def current(self) -> bool:
        """Whether the references still are the optimizer's state."""
        return self.exact and self._fingerprint() == self.fingerprint

    def pack(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
        """A copy of every tensor, concatenated per dtype, with the hyper-parameters and the index `unpack` reads
        (JSON)."""
        with torch.no_grad():  # torch.cat writes a new buffer: the copy, taken between two steps
            flat = {dtype: torch.cat(parts).to("cpu") for dtype, parts in self.parts.items()}
        groups = self.optimizer.param_groups
        hyper = {key: _frozen(groups[group][name]) for key, group, name in self.hyper}
        return flat, hyper, self.index_json


def _entries(folder: str) -> list[str]:
    """The names in `folder`; none when it is gone (the ranks of a node prune the same folders)."""
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_held(folder: str, mine: str) -> None:
    """Remove the files of step folder `folder` whose names hold `mine` (one holder's), then the folder once empty
    (other holders' copies keep it)."""
    for name in _entries(folder):
        if mine in name:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def _read_no_follow(path: str, limit: int) -> bytes:
    """At most `limit` bytes of the regular file `path`, never through a link at its name (a FIFO does not block
    the open; anything but a regular file is an OSError)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return handle.read(limit)


def _frozen(value: Any) -> Any:
    """`value` itself when immutable (numbers, strings, tuples of them), else a deep copy."""
    if value is None or isinstance(value, (int, float, bool, str)):
        return value
    if isinstance(value, tuple) and all(isinstance(v, (int, float, bool, str)) for v in value):
        return value
    return copy.deepcopy(value)


def _local(value: Any) -> Any:
    """A DTensor's local shard; anything else as it is."""
    return value.to_local() if hasattr(value, "to_local") else value


@dataclass
class MemoryRestore:
    """What a memory restore brought back."""

    step: int
    train_state: dict[str, Any]
    saved_world_size: int
    rng_restored: bool
    source: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    """The memory rung's result: restored (or None) and, either way, what was refused and why not."""

    restored: MemoryRestore | None
    refused: list[Refusal]
    reason: str


class MemoryTier:
    """Host-memory copies of every rank's state, one kept locally and one on a buddy rank's node."""

    def __init__(
        self, cfg: CheckpointConfig, layout: str, replicated: bool, local_world: int, node: int,
        record: Callable[[TierDecision], None] | None = None,
    ) -> None:  # fmt: skip
        """`replicated`: every data-parallel rank holds the whole model and optimizer state (DDP). `record`: where
        the decisions of memory_every_steps=auto go (rank 0's run output; None: the log only)."""
        self.cfg, self.layout, self.replicated = cfg, layout, replicated
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.local_world, self.node = local_world, node
        self.folder = node_folder(cfg, node)
        self.key = checkpoint_key()
        self.buddy = buddy_of(self.rank, self.world, local_world)
        self.source = next(r for r in range(self.world) if buddy_of(r, self.world, local_world) == self.rank)
        # The exchange runs beside training's collectives: a gloo group of its own (made by every rank, now).
        self._group = dist.new_group(backend="gloo") if self.world > 1 else None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._view: StateView | None = None
        self.stalls_s: list[float] = []  # per snapshot: training held, in all
        self.waits_s: list[float] = []  # of which waiting for the previous copy's exchange
        os.makedirs(self.folder, exist_ok=True)
        # memory_every_steps=auto: the node's memory as it is at start; fit and interval decided at the first
        # snapshot point (the optimizer's state exists from the first step on), the interval again from the stalls.
        self.auto = cfg.memory_every_steps == "auto"
        self.every: int | None = None if self.auto else int(cfg.memory_every_steps or 0) or None
        self.decided = not self.auto
        self.available = available_bytes(self.folder) if self.auto else (0, "")
        self.record = record
        self._window = StallWindow()
        self._fit_bytes = (0.0, 0.0, 0.0)  # need, allowed, state
        self._last: tuple[int, float] | None = None  # step and time the previous snapshot let training go on

    def due(self, step: int) -> bool:
        """Whether a copy is taken after `step` (auto: the first step of this start decides the fit there)."""
        if not self.decided:
            return True
        return self.every is not None and step % self.every == 0

    def _agree(self, values: list[float]) -> list[float]:
        """The largest of each value over every rank (the tier's own group; no exchange is in flight)."""
        if self._group is None:
            return values
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group)
        return tensor.tolist()

    def _decide(self, step: int, decision: TierDecision) -> None:
        self.decided = True
        if self.rank == 0:
            log.info("%s", decision.describe())
            if self.record is not None:
                try:
                    self.record(decision)
                except Exception as err:  # noqa: BLE001 - the record is evidence; training goes on
                    log.warning("could not record the memory tier's decision at step %d: %s", step, err)

    def _decide_fit(self, step: int, state_bytes: float) -> bool:
        """memory_every_steps=auto's first decision, the same on every rank: whether the tier fits each node."""
        mine = fit(state_bytes, self.local_world, self.cfg.memory_budget_mib, self.available)
        largest, refused = self._agree([state_bytes, 0.0 if mine.fits else 1.0])
        verdict = fit(largest, self.local_world, self.cfg.memory_budget_mib, self.available)
        fits = not refused
        reason = verdict.reason or ("" if fits else "another node's memory does not hold them (its log says why)")
        self.every = 1 if fits else None
        self._fit_bytes = (verdict.need_bytes, verdict.allowed_bytes, largest)
        self._decide(step, TierDecision(step, fits, self.every, verdict.need_bytes, verdict.allowed_bytes, largest,
                                        reason=reason))  # fmt: skip
        return fits

    def _storage_every(self) -> int | None:
        """checkpoint.save_every_steps when it is a number (auto or None: no bound on the tier's interval)."""
        every = self.cfg.save_every_steps
        return every if isinstance(every, int) else None

    def _review(self, step: int) -> None:
        """memory_every_steps=auto: choose the interval again from the measured stalls (every rank the same)."""
        if not self.auto or self.every is None or not self._window.due():
            return
        proposal = int(self._agree([float(self._window.proposal(self._storage_every()))])[0])
        if proposal != self.every or self._window.chosen == 1:  # the first choice is recorded, later ones if new
            stall, step_s = self._window.medians()
            self.every = proposal
            need, allowed, state = self._fit_bytes
            self._decide(step, TierDecision(step, True, proposal, need, allowed, state, stall, step_s))

    # ---- save -------------------------------------------------------------------------------

    def snapshot(
        self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, train_state: dict[str, Any]
    ) -> float:
        """Copy this rank's state at `step` and keep and exchange it in the background; the seconds training was
        held (including the wait for the previous exchange)."""
        started = time.perf_counter()
        self.wait()
        self.waits_s.append(time.perf_counter() - started)
        self._review(step)
        if self._view is None or self._view.optimizer is not optimizer or not self._view.current():
            self._view = StateView(model, optimizer)
        state_bytes = self._view.nbytes  # known before the copy is made: a state that does not fit is not copied
        if not self.decided and not self._decide_fit(step, state_bytes):
            return 0.0
        flat, hyper, index = self._view.pack()
        if not self._view.exact:  # hyper-parameters not found in param_groups: read them the slow way
            hyper = {k: v for k, v in get_state_dict(model, optimizer, options=_OPTIONS)[1].items()
                     if not isinstance(v, torch.Tensor)}  # fmt: skip
        meta = {"step": step, "rank": self.rank, "world_size": self.world, "layout": self.layout,
                "train_state": train_state, "rng": capture_rng()}  # fmt: skip
        state = {"flat": flat, "hyper": hyper, "index": index, "meta": json.dumps(meta)}
        work: Callable[..., None] = self._keep
        args: tuple[Any, ...] = (step, state)
        if state_bytes < BACKGROUND_MIN_BYTES:
            # Small: serialised and committed here, cheaper than a thread's GIL hand-offs; only the exchange, which
            # waits for the peer with the GIL released, goes to the background.
            work, args = self._share, (step, *self._commit_or_nothing(step, state))
        if self._group is None and work == self._share:
            work(*args)  # a lone rank: nothing to exchange
        else:
            self._thread = threading.Thread(target=work, args=args, name=f"memory-copy-{step}", daemon=True)
            self._thread.start()
        ended = time.perf_counter()
        stall = ended - started
        self.stalls_s.append(stall)
        last = self._last
        between = None if last is None or step <= last[0] else (started - last[1]) / (step - last[0])
        self._window.add(stall, between)
        self._last = (step, ended)
        return stall

    def wait(self) -> None:
        """Wait for the copy in flight (if any); a failed one is logged: the tier is best effort, storage stays."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._error is not None:
            log.warning("in-memory copy failed on rank %d: %s", self.rank, self._error)
            self._error = None

    def _keep(self, step: int, state: dict[str, Any]) -> None:
        """Serialise, commit and share the copy of `step` (all on a background thread: large copies)."""
        self._share(step, *self._commit_or_nothing(step, state))

    def _commit_or_nothing(self, step: int, state: dict[str, Any]) -> tuple[bytes, bytes]:
        """`_commit_own`, or empty bytes when it failed (logged): the buddy still takes part in the exchange."""
        try:
            return self._commit_own(step, state)
        except Exception as err:  # noqa: BLE001 - the tier is best effort: training goes on, storage stays
            log.warning("in-memory copy of step %d failed on rank %d: %s", step, self.rank, err)
            return b"", b""

    def _commit_own(self, step: int, state: dict[str, Any]) -> tuple[bytes, bytes]:
        """The copy's bytes and its record (signed when a key is set), both written to this node's folder."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        data = buffer.getvalue()
        record: dict[str, Any] = {
            "format": FORMAT, "step": step, "rank": self.rank, "world_size": self.world, "layout": self.layout,
            "replicated": self.replicated, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
            "created_unix_s": time.time(),
        }  # fmt: skip
        if self.key is not None:
            record = sign_commit(record, self.key)
        raw = json.dumps(record).encode()
        self._write(step, copy_name(self.rank, self.rank), data, raw)
        return data, raw

    def _share(self, step: int, data: bytes, raw: bytes) -> None:
        """Send the copy to the buddy, keep the source's as a peer copy, prune old steps (on a background thread:
        its waits for the peer release the GIL)."""
        try:
            if self._group is not None:
                peer_data, peer_raw = self._exchange(data, raw)
                if peer_raw:  # empty: the source's own copy failed
                    self._write(step, copy_name(self._peer_rank(peer_raw), self.rank), peer_data, peer_raw)
            self._prune()
        except BaseException as err:  # noqa: BLE001 - reported by the next wait(); training goes on
            self._error = err

    def _peer_rank(self, raw: bytes) -> int:
        """The rank a received record names (its file name), `source` when the record is not readable."""
        try:
            rank = json.loads(raw)["rank"]
            return rank if isinstance(rank, int) and 0 <= rank < self.world else self.source
        except (ValueError, KeyError, TypeError):
            return self.source

    def _exchange(self, data: bytes, raw: bytes) -> tuple[bytes, bytes]:
        """Send this rank's copy and record to the buddy and receive the source's: lengths first, then the bytes."""
        sizes = torch.tensor([len(data), len(raw)], dtype=torch.int64)
        theirs = torch.zeros(2, dtype=torch.int64)
        for work in (dist.isend(sizes, self.buddy, group=self._group),
                     dist.irecv(theirs, self.source, group=self._group)):  # fmt: skip
            work.wait()
        received = torch.empty(int(theirs.sum()), dtype=torch.uint8)
        works = []
        if data or raw:  # nothing is sent (and nothing awaited) for a copy that failed
            payload = torch.frombuffer(bytearray(data + raw), dtype=torch.uint8)
            works.append(dist.isend(payload, self.buddy, group=self._group))
        if received.numel():
            works.append(dist.irecv(received, self.source, group=self._group))
        for work in works:
            work.wait()
        blob = received.numpy().tobytes()
        return blob[: int(theirs[0])], blob[int(theirs[0]) :]

    def _write(self, step: int, stem: str, data: bytes, raw: bytes) -> None:
        """The copy, then its record (the commit), each to a temporary name and renamed."""
        folder = os.path.join(self.folder, step_dir_name(step))
        os.makedirs(folder, exist_ok=True)
        for name, content in ((f"{stem}.pt", data), (f"{stem}.json", raw)):
            tmp = os.path.join(folder, f".tmp-{os.getpid()}-{name}")
            with open(tmp, "wb") as out:
                out.write(content)
            os.replace(tmp, os.path.join(folder, name))

    def _prune(self) -> None:
        """Remove the copies this rank saved in steps older than its KEEP_STEPS newest."""
        mine = f".by-{self.rank:05d}."
        steps = []
        for entry in _entries(self.folder):
            match = _STEP.fullmatch(entry)
            if match and any(mine in f for f in _entries(os.path.join(self.folder, entry))):
                steps.append(int(match.group(1)))
        for step in sorted(steps)[:-KEEP_STEPS]:
            _remove_held(os.path.join(self.folder, step_dir_name(step)), mine)

    def _node_folders(self) -> list[str]:
        """This host's node folders of the job: its own, and those of the group ranks it had in earlier attempts
        (torchrun's rendezvous may number the nodes differently after a restart)."""
        job = os.path.dirname(self.folder)
        if not os.path.isdir(job):
            return []
        return sorted(e for e in os.listdir(job) if _NODE.fullmatch(e) and os.path.isdir(os.path.join(job, e)))

    def discard(self) -> None:
        """At the end of a finished run: wait for the copy in flight, then free the host memory this rank held."""
        self.wait()
        mine = f".by-{self.rank:05d}."
        job = os.path.dirname(self.folder)
        try:
            for node in self._node_folders():
                for entry in _entries(os.path.join(job, node)):
                    if _STEP.fullmatch(entry):
                        _remove_held(os.path.join(job, node, entry), mine)
        except OSError as err:  # a finished run is not failed by its housekeeping
            log.warning("could not free the in-memory copies of rank %d under %s: %s", self.rank, job, err)

    # ---- restore ----------------------------------------------------------------------------

    def _inventory(self) -> tuple[list[Offer], list[Refusal]]:
        """The copies in this host's node folders whose records and sizes are sound (the node's first rank lists
        them)."""
        offers: list[Offer] = []
        refused: list[Refusal] = []
        if self.rank % self.local_world != 0:
            return offers, refused
        job = os.path.dirname(self.folder)
        for node in self._node_folders():
            for entry in sorted(os.listdir(os.path.join(job, node))):
                folder = os.path.join(job, node, entry)
                if _STEP.fullmatch(entry) and os.path.isdir(folder):
                    self._list_step(f"{node}/{entry}", folder, offers, refused)
        return offers, refused

    def _list_step(self, label: str, folder: str, offers: list[Offer], refused: list[Refusal]) -> None:
        """Offer each copy in one step folder (`label`: node-N/step-S) whose record and size are sound."""
        for name in sorted(os.listdir(folder)):
            if not _COPY.fullmatch(name):
                continue
            copy_label = f"{label}/{name[:-5]}"
            where = os.path.join(folder, name)
            try:
                raw = _read_no_follow(where, _MAX_RECORD_BYTES + 1)
                if len(raw) > _MAX_RECORD_BYTES:
                    raise CheckpointFormatError(where, f"is larger than {_MAX_RECORD_BYTES} bytes")
                record = check_record(parse_json(raw, where), where)
                if step_dir_name(record["step"]) != label.split("/")[1]:
                    raise CheckpointFormatError(where, f"says step {record['step']} but sits in {label}")
            except (OSError, CheckpointFormatError) as err:
                refused.append(Refusal(copy_label, f"its record is unreadable: {err}"))
                continue
            try:
                found = os.stat(os.path.join(folder, f"{name[:-5]}.pt"), follow_symlinks=False)
            except OSError as err:
                refused.append(Refusal(copy_label, f"its data is missing: {err.strerror}"))
                continue
            size = found.st_size
            if not stat.S_ISREG(found.st_mode):
                refused.append(Refusal(copy_label, "its data is not a regular file (a link or a device: planted?)"))
            elif size != record["bytes"]:
                refused.append(Refusal(copy_label, f"holds {size} bytes, its record says {record['bytes']}"))
            else:
                offers.append(Offer(self.rank, copy_label, record))

    def _read_copy(self, offer: Offer) -> bytes:
        """The bytes of a copy this rank listed (at most what its record says, plus one to notice a longer file)."""
        node, step, stem = offer.name.split("/")
        path = os.path.join(os.path.dirname(self.folder), node, step, f"{stem}.pt")
        return _read_no_follow(path, offer.record["bytes"] + 1)

    def restore(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, storage_step: Callable[[], int | None]
    ) -> Outcome:
        """Restore model, optimizer, RNG and train state from the newest complete copies (collective); every rank
        returns the same outcome. `storage_step` gives the newest committed step on storage (None: none, or the
        storage could not be listed); it is asked only when there are copies."""
        offers, refused = self._inventory()
        gathered = all_gather((offers, refused))
        offers = [o for part in gathered for o in part[0]]
        refused = list(dict.fromkeys(r for part in gathered for r in part[1]))  # one host may be listed twice
        if not offers:
            return Outcome(None, refused, "no copies in host memory")
        newest_on_storage = storage_step()
        names: set[str] = set()
        plans, reason = choose(offers, self.world, self.layout, self.replicated, newest_on_storage)
        for plan in plans:
            states = self._fetch(plan, names, refused)
            if states is None:
                reason = f"step {plan.step}: a rank has no sound copy left"
                continue
            problem = self._apply(model, optimizer, states)
            if problem:
                reason = f"step {plan.step}: {problem}"
                continue
            state, source = states
            if plan.rng_restored:
                restore_rng(state["meta"]["rng"])
            restored = MemoryRestore(
                plan.step, state["meta"]["train_state"], int(state["meta"]["world_size"]), plan.rng_restored, source
            )
            return Outcome(restored, refused, "")
        return Outcome(None, refused, reason or "no complete step in host memory")

    def _fetch(
        self, plan: Plan, names: set[str], refused: list[Refusal]
    ) -> tuple[dict[str, Any], dict[str, str]] | None:
        """Every rank's copy for `plan`, sent by a holder and verified here; refused copies are recorded (every
        rank alike) and the next candidate tried. This rank's state and who sent each rank's (or None)."""
        mine: dict[str, Any] | None = None
        done: dict[int, str] = {}
        while True:
            picks: dict[int, Offer] = {}
            for target in range(self.world):
                if target in done:
                    continue
                left = [o for o in plan.candidates[target] if o.name not in names]
                if not left:
                    return None
                picks[target] = left[0]
            works, received = [], None
            for target, offer in sorted(picks.items()):
                if offer.holder == self.rank and target != self.rank:
                    data = torch.frombuffer(bytearray(self._padded(offer)), dtype=torch.uint8)
                    works.append(dist.isend(data, target))
            if self.rank in picks:
                offer = picks[self.rank]
                if offer.holder == self.rank:
                    received = self._padded(offer)
                else:
                    buffer = torch.empty(offer.record["bytes"] + 1, dtype=torch.uint8)
                    works.append(dist.irecv(buffer, offer.holder))
            for work in works:
                work.wait()
            verdict = None
            if self.rank in picks:
                offer = picks[self.rank]
                raw = received if received is not None else buffer.numpy().tobytes()
                if raw[-1:] == b"\2":
                    state, problem = None, "could not be read by its holder (removed since it was listed)"
                elif raw[-1:] != b"\0":
                    state, problem = None, f"holds more bytes than its record says ({offer.record['bytes']})"
                else:
                    state, problem = verify_copy(raw[:-1], offer.record, self.key, offer.name)
                if state is None:
                    verdict = Refusal(offer.name, problem)
                else:
                    mine = state
            verdicts = all_gather(verdict)
            for target, offer in sorted(picks.items()):
                if verdicts[target] is None:
                    done[target] = f"{offer.name} (rank {offer.rank}'s state, sent by rank {offer.holder})"
                else:
                    names.add(offer.name)
                    refused.append(verdicts[target])
            if len(done) == self.world:
                assert mine is not None
                return mine, {f"rank {t}": done[t] for t in sorted(done)}

    def _padded(self, offer: Offer) -> bytes:
        """The copy's bytes in a buffer of its record's size + 1: the marker byte says whether the file held
        at most that many bytes (0), more (1: refused without sending it all) or could not be read (2)."""
        try:
            data = self._read_copy(offer)
        except OSError:  # removed since it was listed: the receiver refuses it
            return b"\0" * offer.record["bytes"] + b"\2"
        if len(data) > offer.record["bytes"]:
            return data[: offer.record["bytes"]] + b"\1"
        return data + b"\0" * (offer.record["bytes"] + 1 - len(data))

    def _apply(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, states: tuple[dict[str, Any], dict[str, str]]
    ) -> str:
        """Load this rank's copy into the model and optimizer when every rank can (collective); why not, else."""
        state = states[0]
        model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        problem = _fits(model_sd, state["model"], "model") or _fits(optim_sd, state["optim"], "optimizer")
        problems = [p for p in all_gather(problem) if p]
        if problems:
            return problems[0]
        for current, saved in ((model_sd, state["model"]), (optim_sd, state["optim"])):
            for name, value in current.items():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if hasattr(value, "to_local") else value
                    with torch.no_grad():
                        local.copy_(saved[name])
                else:
                    current[name] = saved[name]
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=_OPTIONS)
        return ""


def _fits(current: dict[str, Any], saved: dict[str, Any], what: str) -> str | None:
    """Why `saved` cannot be loaded into `current` (None: every entry is there with the local shape)."""
    if set(current) != set(saved):
        extra = sorted(set(saved) ^ set(current))[:3]
        return f"the copy's {what} state has other entries than this job's ({', '.join(extra)})"
    for name, value in current.items():
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            other = saved[name]
            if not isinstance(other, torch.Tensor) or other.shape != local.shape or other.dtype != local.dtype:
                return f"the copy's {what} entry {name} does not match this job's shape or dtype"
    return None
