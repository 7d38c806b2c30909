"""The digest a healthy replica group seals its state with before a healing group pulls it (training/replica.py).

torchft's HTTP checkpoint transport hands the healing group whatever arrives on the socket, unpickled with
`torch.load(weights_only=True)`: no code runs, but nothing says the tensors are the ones the peer sent. The sender
wraps its state as `{"state": ..., "seal": {...}}`, the seal holding a digest over every tensor's dtype, shape and
bytes and every other value of the state (the train state: step, sampler position, LR schedule, loss scale), in a
fixed order, together with the sender's name and step. The receiver recomputes it before it loads anything.

With TDEPLOY_CHECKPOINT_KEY set (training/checkpoint/trust.py) the digest is an HMAC-SHA256 under that key, so a
party on the network without the key cannot forge a copy; without it, a bare SHA-256 that catches corruption, not
tampering. The receiver's rules follow the storage checkpoints' table: key set and the seal unkeyed, or key unset
and the seal keyed, is refused as well as a digest that differs.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from training.checkpoint.trust import KEY_ENV, checkpoint_key

STATE_FIELD, SEAL_FIELD = "state", "seal"
SHA256, HMAC_SHA256 = "sha256", "hmac-sha256"


class PeerStateRefused(ValueError):
    """A replica group's state that failed its seal: not loaded; the healing group takes the next rung."""

    def __init__(self, peer: str, step: int | None, reason: str) -> None:
        super().__init__(f"refused the state of {peer} at step {step}: {reason}")
        self.peer, self.step, self.reason = peer, step, reason

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.peer, self.step, self.reason))


@dataclass(frozen=True)
class Opened:
    """A state whose seal verified, and who sent it at which step."""

    state: dict[str, Any]
    peer: str
    step: int


def _feed(h: Any, value: Any, path: str) -> None:
    """Add `value` to the digest `h`: tensors by dtype, shape and raw bytes; containers in a fixed order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{path}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, Mapping):
        h.update(f"D{path}|{len(value)}|".encode())
        for key in sorted(value, key=repr):
            _feed(h, value[key], f"{path}/{key!r}")
    elif isinstance(value, (list, tuple)):
        h.update(f"L{path}|{len(value)}|".encode())
        for i, item in enumerate(value):
            _feed(h, item, f"{path}[{i}]")
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        h.update(f"V{path}|{type(value).__name__}|{value!r}|".encode())
    else:
        raise TypeError(
            f"{path}: a {type(value).__name__} in a replica state has no digest; send tensors and plain values"
        )


def digest(state: Mapping[str, Any], peer: str, step: int, key: bytes | None) -> str:
    """The hex digest of `state` sent by `peer` at `step`: HMAC-SHA256 under `key`, or SHA-256 without one."""
    h = hmac.new(key, digestmod=hashlib.sha256) if key is not None else hashlib.sha256()
    h.update(f"{peer}|{step}|".encode())
    _feed(h, state, "")
    return h.hexdigest()


def seal(state: dict[str, Any], peer: str, step: int) -> dict[str, Any]:
    """What the healthy group sends: `state` and its seal (keyed when TDEPLOY_CHECKPOINT_KEY is set)."""
    key = checkpoint_key()
    return {
        STATE_FIELD: state,
        SEAL_FIELD: {
            "algorithm": SHA256 if key is None else HMAC_SHA256,
            "peer": peer,
            "step": step,
            "digest": digest(state, peer, step, key),
        },
    }


def open_sealed(received: Any) -> Opened:
    """The state inside `received` once its seal verifies; PeerStateRefused (naming the peer and step) otherwise."""
    if not isinstance(received, Mapping) or not isinstance(received.get(SEAL_FIELD), Mapping):
        raise PeerStateRefused("an unknown peer", None, "the state carries no seal (sent by a trainer without one?)")
    info = received[SEAL_FIELD]
    peer, step, algorithm = info.get("peer"), info.get("step"), info.get("algorithm")
    if not isinstance(peer, str) or not isinstance(step, int) or isinstance(step, bool):
        raise PeerStateRefused(repr(peer), None, f"the seal names no peer and step ({dict(info)!r})")
    key = checkpoint_key()
    if key is not None and algorithm != HMAC_SHA256:
        raise PeerStateRefused(peer, step, f"{KEY_ENV} is set here but the state is sealed with {algorithm!r}, "
                               "not signed: the sender runs without the key (or the seal was replaced)")  # fmt: skip
    if key is None and algorithm != SHA256:
        raise PeerStateRefused(peer, step, f"the state is signed ({algorithm!r}) but {KEY_ENV} is unset here; "
                               "set it to the key the other replica groups use")  # fmt: skip
    state = received.get(STATE_FIELD)
    if not isinstance(state, dict):
        raise PeerStateRefused(peer, step, "the sealed state is not a dict")
    try:
        expected = digest(state, peer, step, key)
    except TypeError as err:
        raise PeerStateRefused(peer, step, str(err)) from err
    got = info.get("digest")
    if not isinstance(got, str) or not hmac.compare_digest(expected, got):
        raise PeerStateRefused(peer, step, f"{algorithm} digest mismatch: the state changed after it was sealed")
    return Opened(state, peer, step)
