"""The in-memory checkpoint tier's pieces that need no job: the copy's record, the receiver's checks (digest,
signature, weights-only unpickle), which step the inventory restores, and the recovery record's reader."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.launch.kubernetes import render_manifests, validate_pytorchjob
from training.checkpoint import KEY_ENV, CheckpointFormatError, sign_commit
from training.checkpoint.memory import (
    FORMAT,
    MemoryTier,
    Offer,
    buddy_of,
    check_record,
    choose,
    node_folder,
    verify_copy,
)
from training.checkpoint.rng import capture_rng
from training.config import CheckpointConfig
from training.recovery_record import RecoveryEvent, RecoveryFileError, Refusal, append_event, recovery_events

KEY = b"k" * 32


def _copy(step: int = 4, rank: int = 1, world: int = 2, key: bytes | None = None) -> tuple[bytes, dict[str, Any]]:
    """The bytes and record of a copy as MemoryTier writes them."""
    index = [["model", "w", "float32", [3], 0], ["optim", "state.w.step", "float32", [], 3]]
    meta = {"step": step, "rank": rank, "world_size": world, "layout": "", "train_state": {"step": step},
            "rng": capture_rng()}  # fmt: skip
    buffer = io.BytesIO()
    torch.save({"flat": {"float32": torch.tensor([1.0, 1.0, 1.0, 4.0])}, "hyper": {"param_groups.w.lr": 0.1},
                "index": json.dumps(index), "meta": json.dumps(meta)}, buffer)  # fmt: skip
    data = buffer.getvalue()
    record = {"format": FORMAT, "step": step, "rank": rank, "world_size": world, "layout": "", "replicated": True,
              "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "created_unix_s": 0.0}  # fmt: skip
    return data, sign_commit(record, key) if key else record


def test_a_sound_copy_is_accepted_with_its_state() -> None:
    data, record = _copy()
    state, problem = verify_copy(data, record, None, "copy")
    assert problem == "" and state is not None
    assert state["meta"]["step"] == 4 and torch.equal(state["model"]["w"], torch.ones(3))
    assert state["optim"] == {"state.w.step": torch.tensor(4.0), "param_groups.w.lr": 0.1}


def test_a_copy_whose_bytes_were_altered_is_refused_by_its_digest() -> None:
    data, record = _copy()
    altered = bytearray(data)
    altered[len(altered) // 2] ^= 0xFF
    state, problem = verify_copy(bytes(altered), record, None, "copy")
    assert state is None and problem == "fails its sha256 check (the copy was altered or torn)"


def test_a_copy_cut_short_is_refused_by_its_size() -> None:
    data, record = _copy()
    state, problem = verify_copy(data[:-10], record, None, "copy")
    assert state is None and problem == f"holds {len(data) - 10} bytes, its record says {len(data)}"


@pytest.mark.parametrize(
    ("signed_with", "expected"),
    [
        (KEY, ""),
        (b"another-key-of-32-characters!!!!", "its record signature does not match"),
        (None, "its record is not signed while"),
    ],
)
def test_with_a_key_only_copies_signed_with_it_are_believed(
    monkeypatch: pytest.MonkeyPatch, signed_with: bytes | None, expected: str
) -> None:
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    data, record = _copy(key=signed_with)
    state, problem = verify_copy(data, record, KEY, "copy")
    assert problem.startswith(expected) and (state is None) == bool(expected)


def test_a_copy_whose_record_was_rewritten_with_a_new_digest_is_refused_by_its_signature() -> None:
    data, record = _copy(key=KEY)
    forged = bytearray(data)
    forged[-5] ^= 0x01
    record = {**record, "sha256": hashlib.sha256(bytes(forged)).hexdigest()}  # the attacker rehashes, cannot re-sign
    state, problem = verify_copy(bytes(forged), record, KEY, "copy")
    assert state is None and problem.startswith("its record signature does not match")


def test_a_copy_holding_code_is_refused_by_the_weights_only_unpickle() -> None:
    class Planted:
        def __reduce__(self) -> tuple[Any, ...]:
            return (print, ("planted",))

    buffer = io.BytesIO()
    torch.save({"flat": {}, "hyper": {}, "index": "[]", "meta": Planted()}, buffer)
    data = buffer.getvalue()
    _, record = _copy()
    record = {**record, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    state, problem = verify_copy(data, record, None, "copy")
    assert state is None and problem.startswith("is not a copy this trainer wrote: UnpicklingError")


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"format": "other"}, "is not a memory copy record"),
        ({"step": -1}, "has step=-1"),
        ({"rank": 2}, "has rank 2 of world 2"),
        ({"sha256": "abc"}, "has sha256='abc'"),
        ({"replicated": "yes"}, "has no layout string or replicated flag"),
    ],
)
def test_a_record_that_is_not_what_the_tier_writes_is_refused_naming_the_field(
    change: dict[str, Any], problem: str
) -> None:
    _, record = _copy()
    check_record(record, "r.json")
    with pytest.raises(CheckpointFormatError) as raised:
        check_record({**record, **change}, "r.json")
    assert raised.value.problem.startswith(problem)


def _offers(step: int, ranks: list[int], world: int = 2, layout: str = "", replicated: bool = True,
            holder_of: dict[int, int] | None = None) -> list[Offer]:  # fmt: skip
    offers = []
    for rank in ranks:
        _, record = _copy(step, rank, world)
        record = {**record, "layout": layout, "replicated": replicated}
        holder = (holder_of or {}).get(rank, rank)
        offers.append(Offer(holder, f"node-{holder}/step-{step:08d}/rank-{rank:05d}.by-{holder:05d}", record))
    return offers


# (what the nodes hold, this job's world, layout, replicated, storage step) -> (steps usable, RNG restored, why not)
# fmt: off
CHOICES = [
    ("every rank's copy at 8 and 7", _offers(8, [0, 1]) + _offers(7, [0, 1]), 2, "", True, 5, [8, 7], True, ""),
    ("rank 1's copy at 8 lost: DDP takes a replica's", _offers(8, [0]), 2, "", True, 5, [8], False, ""),
    ("sharded layout, rank 1 lost", _offers(8, [0], replicated=False), 2, "", False, 5, [], None, "incomplete"),
    ("storage is newer", _offers(8, [0, 1]), 2, "", True, 9, [], None, "older than the checkpoint of step 9"),
    ("storage at the same step", _offers(8, [0, 1]), 2, "", True, 8, [8], True, ""),
    ("a smaller world, DDP", _offers(8, [0, 1]), 1, "", True, None, [8], False, ""),
    ("another world, sharded", _offers(8, [0, 1], layout="pp1 dp1x2 cp1 tp1 ep1", replicated=False), 4,
     "pp1 dp1x4 cp1 tp1 ep1", False, None, [], None, "restores from memory only under the same world and layout"),
    ("nothing in memory", [], 2, "", True, None, [], None, "no copies in host memory"),
]
# fmt: on


@pytest.mark.parametrize(
    ("offers", "world", "layout", "replicated", "storage", "steps", "rng", "why"),
    [c[1:] for c in CHOICES],
    ids=[c[0] for c in CHOICES],
)
def test_the_inventory_restores_the_newest_complete_step_not_older_than_storage(
    offers: list[Offer],
    world: int,
    layout: str,
    replicated: bool,
    storage: int | None,
    steps: list[int],
    rng: bool | None,
    why: str,
) -> None:
    plans, reason = choose(offers, world, layout, replicated, storage)
    assert [p.step for p in plans] == steps
    if plans:
        assert plans[0].rng_restored is rng and set(plans[0].candidates) == set(range(world))
    assert why in reason


def test_each_rank_prefers_its_own_copy_held_by_itself_then_the_peer_copy() -> None:
    own = _offers(8, [0, 1])
    peers = _offers(8, [0, 1], holder_of={0: 1, 1: 0})
    (plan,), _ = choose(peers + own, 2, "", True, None)
    assert [o.name for o in plan.candidates[1]][:2] == ["node-1/step-00000008/rank-00001.by-00001",
                                                        "node-0/step-00000008/rank-00001.by-00000"]  # fmt: skip


def test_a_refused_copy_is_passed_over_for_the_next_holder() -> None:
    offers = _offers(8, [0, 1]) + _offers(8, [1], holder_of={1: 0})
    (plan,), _ = choose(offers, 2, "", False, None, refused={"node-1/step-00000008/rank-00001.by-00001"})
    assert [o.holder for o in plan.candidates[1]] == [0]


def test_the_buddy_is_on_the_next_node_and_the_next_rank_on_one_node() -> None:
    assert [buddy_of(r, 4, 2) for r in range(4)] == [2, 3, 0, 1]
    assert [buddy_of(r, 2, 2) for r in range(2)] == [1, 0]


def test_each_job_and_node_has_a_folder_of_its_own(tmp_path: Path) -> None:
    cfg = CheckpointConfig(url="/ckpt/a", memory_dir=str(tmp_path))
    other = CheckpointConfig(url="/ckpt/b", memory_dir=str(tmp_path))
    assert node_folder(cfg, 0) != node_folder(cfg, 1) != node_folder(other, 1)
    assert node_folder(CheckpointConfig(url="/ckpt/a"), 0).startswith("/dev/shm/tdeploy-memory/")


@pytest.mark.parametrize("bad", ["shm/copies", "/dev/shm/../etc", "/dev/shm/a\nb", "s3://bucket/x"])
def test_memory_dir_must_be_an_absolute_local_path(bad: str) -> None:
    with pytest.raises(ValueError, match="memory_dir") as raised:
        CheckpointConfig(url="/ckpt", memory_dir=bad)
    assert "/dev/shm/tdeploy-memory" in str(raised.value)


def test_recovery_events_read_back_as_written_and_a_bad_line_is_named(tmp_path: Path) -> None:
    event = RecoveryEvent("memory", 8, 2, 1, {"rank 1": "node-0/..."}, [Refusal("node-1/x", "fails")], 0.5)
    append_event(str(tmp_path), event)
    append_event(str(tmp_path), RecoveryEvent("fresh", None, 2))
    assert recovery_events(str(tmp_path))[0] == event
    with open(tmp_path / "recovery.jsonl", "a") as out:
        out.write('{"rung": "teleport", "restored_step": 1, "world_size": 2}\n')
    with pytest.raises(RecoveryFileError, match="line 3: rung 'teleport'"):
        recovery_events(str(tmp_path))


@pytest.mark.parametrize(
    ("memory", "mounted"),
    [
        ({"memory_every_steps": 1}, "/dev/shm/tdeploy-memory"),
        ({"memory_every_steps": 2, "memory_dir": "/run/copies"}, "/run/copies"),
        ({"memory_every_steps": "auto"}, "/dev/shm/tdeploy-memory"),
        ({"memory_every_steps": 0}, None),
    ],
)
def test_kubernetes_pods_keep_the_memory_copies_on_a_memory_backed_volume_when_the_tier_is_on(
    make_spec, memory: dict[str, Any], mounted: str | None
) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "nodes": 2},
                      "checkpoint": memory})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts.get("tdeploy-memory") == mounted
    if mounted:
        assert volumes["tdeploy-memory"]["emptyDir"] == {"medium": "Memory"}
    validate_pytorchjob(job)


def test_a_copy_whose_index_points_outside_its_buffers_is_refused() -> None:
    data, record = _copy()
    state = torch.load(io.BytesIO(data), weights_only=True)
    index = json.loads(state["index"])
    index[0][4] = 2  # "w" (3 numbers) from offset 2 of a 4-number buffer
    buffer = io.BytesIO()
    torch.save({**state, "index": json.dumps(index)}, buffer)
    altered = buffer.getvalue()
    record = {**record, "sha256": hashlib.sha256(altered).hexdigest(), "bytes": len(altered)}
    state, problem = verify_copy(altered, record, None, "copy")
    assert (
        state is None
        and problem == "is not a copy this trainer wrote: ValueError: entry 'w' lies outside its " "float32 buffer"
    )


def test_a_packed_view_of_a_model_and_optimizer_unpacks_to_their_state_dicts_and_follows_training() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: PLC0415

    from training.checkpoint.memory import _OPTIONS, StateView, unpack  # noqa: PLC0415

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))

    def train() -> None:
        model(torch.randn(5, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    train()
    view = StateView(model, optimizer)
    train()  # the view follows the live tensors and the changing LR
    assert view.current()
    flat, hyper, index = view.pack()
    model_sd, optim_sd = unpack(flat, hyper, json.loads(index))
    want_model, want_optim = get_state_dict(model, optimizer, options=_OPTIONS)
    assert model_sd.keys() == want_model.keys() and all(torch.equal(model_sd[k], want_model[k]) for k in model_sd)
    assert optim_sd.keys() == want_optim.keys()
    for key, value in want_optim.items():
        assert torch.equal(optim_sd[key], value) if isinstance(value, torch.Tensor) else optim_sd[key] == value, key
    assert optim_sd["param_groups.0.weight.lr"] == pytest.approx(0.1 / 3)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def _tier(tmp_path: Path) -> MemoryTier:
    return MemoryTier(CheckpointConfig(url="/ckpt/job", memory_dir=str(tmp_path)), "", True, 1, 0)


def test_a_lone_rank_restores_its_own_copy_into_a_fresh_model(tmp_path: Path) -> None:
    model, optimizer = _trained(0)
    tier = _tier(tmp_path)
    tier.snapshot(7, model, optimizer, {"step": 7})
    tier.wait()
    fresh, fresh_optimizer = _trained(1)
    outcome = _tier(tmp_path).restore(fresh, fresh_optimizer, lambda: 5)
    assert outcome.restored is not None and outcome.restored.step == 7 and outcome.refused == []
    assert outcome.restored.train_state == {"step": 7} and outcome.restored.rng_restored
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    exp_avg = [o.state_dict()["state"][0]["exp_avg"] for o in (optimizer, fresh_optimizer)]
    assert torch.equal(*exp_avg)
    tier.discard()
    assert not list(Path(tmp_path).rglob("*.pt"))


@pytest.mark.parametrize("hostile", ["fifo record", "linked data", "altered data"])
def test_planted_or_altered_copies_are_refused_and_nothing_is_restored(tmp_path: Path, hostile: str) -> None:
    model, optimizer = _trained(0)
    tier = _tier(tmp_path)
    tier.snapshot(7, model, optimizer, {"step": 7})
    tier.wait()
    (data,) = Path(tmp_path).rglob("*.pt")
    record = data.with_suffix(".json")
    if hostile == "fifo record":
        record.unlink()
        os.mkfifo(record)
    elif hostile == "linked data":
        outside = tmp_path / "outside"
        outside.write_bytes(data.read_bytes())
        data.unlink()
        data.symlink_to(outside)
    else:
        raw = bytearray(data.read_bytes())
        raw[100] ^= 0xFF
        data.write_bytes(bytes(raw))
    fresh, fresh_optimizer = _trained(1)
    before = [p.clone() for p in fresh.parameters()]
    outcome = _tier(tmp_path).restore(fresh, fresh_optimizer, lambda: None)
    assert outcome.restored is None
    (refusal,) = outcome.refused
    assert refusal.copy == "node-0/step-00000007/rank-00000.by-00000"
    assert {"fifo record": "its record is unreadable", "linked data": "its data is not a regular file",
            "altered data": "fails its sha256 check"}[hostile] in refusal.reason  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
