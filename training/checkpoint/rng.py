"""Per-rank RNG states (python, numpy, torch, cuda) as the JSON a checkpoint's rng/rank-<N>.json holds."""

from __future__ import annotations

import base64
import binascii
import random
from typing import Any

import numpy as np
import torch

from training.checkpoint.errors import CheckpointFormatError


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON-safe data."""
    np_state = np.random.get_state()
    state = {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _rng_tensor(encoded: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(encoded, validate=True)), dtype=torch.uint8)


def restore_rng(state: dict[str, Any]) -> None:
    """Inverse of `capture_rng`."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_rng_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_rng_tensor(state["cuda"]))


def check_rng(state: Any, where: str) -> dict[str, Any]:
    """`state` if `restore_rng` can apply it (tried on scratch generators), else CheckpointFormatError."""
    if not isinstance(state, dict) or not {"python", "numpy", "torch"} <= state.keys():
        raise CheckpointFormatError(where, "is not an RNG state: expected a JSON object with python, numpy and torch")
    try:
        version, internal, gauss = state["python"]
        random.Random().setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.Generator().set_state(_rng_tensor(state["torch"]))
        if "cuda" in state:
            _rng_tensor(state["cuda"])
    except (TypeError, ValueError, LookupError, OverflowError, RuntimeError, binascii.Error) as err:
        problem = f"is not an RNG state this trainer saved: {type(err).__name__}: {err}"
        raise CheckpointFormatError(where, problem) from err
    return state
