"""The export's load-time check: a folder that does not reproduce the checkpoint under transformers is refused
before EXPORT.json (naming the largest-deviating tensor or the config field), and nothing is left behind."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from tasks.errors import UserError
from tasks.export import hf
from tasks.export.parity import PARITY_PROMPTS, ExportParityError
from tasks.export.step import EXPORT_RECORD, export_checkpoint
from tests.unit.test_hf_export import DENSE_GQA, TIED, bytes_card, model_config, save_checkpoints, train_config
from training import hf_names
from training.checkpoint import KEY_ENV
from training.config import ModelConfig

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)  # unsigned test checkpoints
    transformers.utils.logging.disable_progress_bar()


def _swap_k_and_v(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault: the export's name table writes our wk as v_proj and our wv as k_proj (the reverse table the
    check reads back with was built from the right one at import)."""
    swapped = []
    for pattern, theirs in hf_names._NAMES:
        if theirs.endswith("k_proj.weight"):
            theirs = theirs.replace("k_proj", "v_proj")
        elif theirs.endswith("v_proj.weight"):
            theirs = theirs.replace("v_proj", "k_proj")
        swapped.append((pattern, theirs))
    monkeypatch.setattr(hf_names, "_NAMES", tuple(swapped))


def test_an_export_with_k_and_v_swapped_is_refused_naming_the_tensor(tmp_path: Path, monkeypatch) -> None:
    cfg = model_config(DENSE_GQA)  # GQA: k_proj and v_proj have the same shape, so transformers loads the swap
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 3)
    _swap_k_and_v(monkeypatch)
    with pytest.raises(ExportParityError) as caught:
        export_checkpoint(train, out=tmp_path / "out" / "hf")
    err = caught.value
    assert isinstance(err, UserError)
    message = str(err)
    assert "export parity failed" in message and "checkpoint step 3" in message
    named = re.search(r"largest-deviating tensor model\.layers\.(\d)\.self_attn\.([kv])_proj\.weight \(ours "
                      r"blocks\.(\d)\.attn\.w([kv])\.weight\)", message)  # fmt: skip
    assert named is not None, message
    assert named.group(1) == named.group(3) and named.group(2) == named.group(4)
    assert err.parity.config_mismatches == [] and err.parity.max_abs_logit_diff > err.parity.tolerance
    assert err.parity.prompts == PARITY_PROMPTS and "fixed token ids" in err.parity.prompts_from
    assert "training/hf_names.py" in message  # the fix names where to look
    assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor a partial one


def _without_rope_theta(original: Any) -> Any:
    def written(*args: Any, **kwargs: Any) -> dict[str, Any]:
        config = original(*args, **kwargs)
        del config["rope_theta"], config["rope_parameters"]  # transformers then reads its default, 10000
        return config

    return written


def test_an_export_that_writes_the_default_rope_theta_is_refused_by_its_logits(tmp_path: Path, monkeypatch) -> None:
    # trained with rope_theta 500; logits of a trained model's size (init_std 0.1) over 64 positions
    cfg = ModelConfig(seq_len=64, **{**TIED, "init_std": 0.1})
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)
    monkeypatch.setattr(hf, "hf_config", _without_rope_theta(hf.hf_config))
    with pytest.raises(ExportParityError) as caught:
        export_checkpoint(train, out=tmp_path / "hf")
    parity = caught.value.parity
    assert parity.config_mismatches == ["rope_theta: 10000.0 in the folder (as transformers reads it) vs 500.0 trained"]
    # the logits alone would refuse it too: the weights are right, the rotary base is not
    assert parity.max_abs_logit_diff > 1000 * parity.tolerance, parity
    assert "config.json differs: rope_theta: 10000.0" in str(caught.value)
    assert not (tmp_path / "hf").exists()


def test_a_sound_export_records_its_parity_in_export_json_and_the_result(tmp_path: Path) -> None:
    cfg = model_config(DENSE_GQA)
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 4)
    result = export_checkpoint(train, out=tmp_path / "hf")
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["parity"] == result.parity.model_dump(mode="json")
    assert result.parity.passed and result.parity.max_abs_logit_diff <= result.parity.tolerance
    assert result.parity.prompts == PARITY_PROMPTS and result.parity.prompt_tokens == cfg.seq_len
    assert result.parity.worst_tensor is None and result.parity.config_mismatches == []
