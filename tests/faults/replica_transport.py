"""Test-only fault for live recovery: the first `sends` states a healthy replica group sends over torchft's HTTP
checkpoint transport arrive with one weight changed, as a corrupted or tampered transfer would (after the sender
sealed it).

Applied to a job's processes through the harness (tests/faults/harness/sitecustomize.py) with
`environment(sends)`: PYTHONPATH with the harness first, TDEPLOY_TEST_PATCH naming `tamper_first_sends`.
"""

from __future__ import annotations

import os
from typing import Any

from tests.faults import HARNESS, ROOT

SENT = {"count": 0}
SENDS_ENV = "TDEPLOY_TEST_TAMPERED_SENDS"


def environment(sends: int = 1) -> dict[str, str]:
    """The variables that apply `tamper_first_sends` to every process of a job."""
    path = os.pathsep.join([str(HARNESS), str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {"PYTHONPATH": path, "TDEPLOY_TEST_PATCH": f"{__name__}:tamper_first_sends", SENDS_ENV: str(sends)}


def _tampered(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of torchft's outgoing state with the first model tensor shifted (the sender's own tensors untouched)."""
    user = state["user"]["default"]
    inner = user.get("state", user)  # sealed ({"state", "seal"}) or, without the seal, the trainer's state itself
    model = dict(inner["model"])
    name = next(iter(model))
    model[name] = model[name].detach().clone() + 1.0
    inner = {**inner, "model": model}
    user = {**user, "state": inner} if "state" in user else inner
    return {**state, "user": {**state["user"], "default": user}}


def tamper_first_sends() -> None:
    """Patch torchft's HTTPTransport so that this process's first TDEPLOY_TEST_TAMPERED_SENDS sends carry a changed
    weight."""
    from torchft.checkpointing.http_transport import HTTPTransport  # noqa: PLC0415 - only in the patched job

    send = HTTPTransport.send_checkpoint

    def send_checkpoint(self: Any, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any) -> None:
        SENT["count"] += 1
        if SENT["count"] <= int(os.environ.get(SENDS_ENV, "1")):
            state_dict = _tampered(state_dict)
        send(self, dst_ranks, step, state_dict, timeout)

    HTTPTransport.send_checkpoint = send_checkpoint  # type: ignore[method-assign]
