"""The seal on the state a healthy replica group sends to a healing one (training/replica_integrity.py)."""

from __future__ import annotations

import pytest
import torch

from training.checkpoint.trust import KEY_ENV
from training.replica_integrity import HMAC_SHA256, SHA256, PeerStateRefused, open_sealed, seal

PEER, STEP = "replica group 0", 12


def _state() -> dict:
    model = torch.nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    optim.step()
    train = {"step": STEP, "epoch": 0, "sample_offset": 96, "scheduler": {"last_epoch": STEP, "_last_lr": [1e-3]},
             "scaler": {}}  # fmt: skip
    return {"model": model.state_dict(), "optim": optim.state_dict(), "train": train}


@pytest.fixture(autouse=True)
def _no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)


def test_an_intact_state_opens_with_its_sender_and_step() -> None:
    state = _state()
    opened = open_sealed(seal(state, PEER, STEP))
    assert (opened.peer, opened.step) == (PEER, STEP) and opened.state is state


def test_one_changed_weight_byte_is_refused_naming_the_peer_and_the_step() -> None:
    sent = seal(_state(), PEER, STEP)
    weight = sent["state"]["model"]["weight"]
    weight.view(-1).view(torch.uint8)[0] ^= 1  # one bit of one float
    with pytest.raises(PeerStateRefused, match=f"refused the state of {PEER} at step {STEP}: sha256 digest mismatch"):
        open_sealed(sent)


@pytest.mark.parametrize(
    ("where", "change"),
    [
        ("train step", lambda s: s["state"]["train"].update(step=STEP + 1)),
        ("sampler position", lambda s: s["state"]["train"].update(sample_offset=0)),
        ("optimizer moment", lambda s: s["state"]["optim"]["state"][0]["exp_avg"].add_(1e-6)),
        ("learning rate", lambda s: s["state"]["optim"]["param_groups"][0].update(lr=1.0)),
        ("claimed step", lambda s: s["seal"].update(step=STEP + 5)),
        ("dtype", lambda s: s["state"]["model"].update(bias=s["state"]["model"]["bias"].double())),
    ],
)
def test_every_part_of_the_state_is_covered(where: str, change) -> None:
    sent = seal(_state(), PEER, STEP)
    change(sent)
    with pytest.raises(PeerStateRefused, match="digest mismatch"):
        open_sealed(sent)


def test_a_state_without_a_seal_is_refused() -> None:
    with pytest.raises(PeerStateRefused, match="carries no seal"):
        open_sealed(_state())


def test_with_the_key_set_the_seal_is_an_hmac_that_a_keyless_sender_cannot_forge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    sent = seal(_state(), PEER, STEP)
    assert sent["seal"]["algorithm"] == HMAC_SHA256
    assert open_sealed(sent).step == STEP
    # a bare sha256 recomputed by someone without the key is refused under the key
    monkeypatch.delenv(KEY_ENV)
    forged = seal(sent["state"], PEER, STEP)
    assert forged["seal"]["algorithm"] == SHA256
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    with pytest.raises(PeerStateRefused, match="not signed"):
        open_sealed(forged)
    # and an HMAC under another key does not verify
    monkeypatch.setenv(KEY_ENV, "x" * 32)
    with pytest.raises(PeerStateRefused, match="hmac-sha256 digest mismatch"):
        open_sealed(sent)


def test_a_signed_state_is_refused_where_the_key_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    sent = seal(_state(), PEER, STEP)
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(PeerStateRefused, match=f"{KEY_ENV} is unset here"):
        open_sealed(sent)
