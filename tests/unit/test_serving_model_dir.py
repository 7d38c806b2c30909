"""A given model folder (the quantize step's, or `tdeploy check-serving --model-dir DIR --step N`) is what the
serving check serves for every model kind, vision-language included, with greedy parity against our model of its
step; nothing is exported."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tasks.serve import step
from tasks.serve.config import ServeConfig
from tasks.serve.step import ServingInputs
from training.checkpoint import KEY_ENV

CHECKS = {"lm": "run_serving_check", "vit": "run_classifier_check", "vlm": "run_captioning_check"}


class _Stop(Exception):
    """Raised by a fake server start: the test has seen what it needed."""


@pytest.mark.parametrize("kind", list(CHECKS))
def test_the_serving_step_hands_a_given_folder_and_its_step_to_every_kinds_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    called = []
    for name in CHECKS.values():
        monkeypatch.setattr(step, name, lambda *args, **kwargs: called.append(args + tuple(kwargs.values())))
    inputs = ServingInputs.model_construct(
        serve=ServeConfig(), train=SimpleNamespace(model=SimpleNamespace(kind=kind)), accelerator="cpu", name="demo",
        out_dir=str(tmp_path), export_root=str(tmp_path / "export"), step=7, model_dir="/q/step-7",
        quantization_json=None, acceptance=None, pod_memory_bytes=None,
    )  # fmt: skip
    step.run_check(inputs)
    assert len(called) == 1 and "/q/step-7" in called[0] and 7 in called[0], called


def test_check_serving_model_dir_reaches_the_check_and_needs_its_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from typer.testing import CliRunner

    import tasks.prepare.step
    from flows.cli import app

    seen: list[ServingInputs] = []
    # the spec's training config as it is (no dataset preparation), and the check itself only recorded
    monkeypatch.setattr(tasks.prepare.step, "data_and_training",
                        lambda parsed, *args, **kwargs: (None, parsed.training_config(str(tmp_path / "ds"))))
    monkeypatch.setattr(step, "run", lambda inputs, publish=None: seen.append(inputs))
    folder = tmp_path / "quantized"
    given = CliRunner().invoke(app, ["check-serving", "examples/vlm.yaml", "--step", "20", "--model-dir", str(folder)])
    assert given.exit_code == 0, given.output
    assert len(seen) == 1 and seen[0].model_dir == str(folder) and seen[0].step == 20
    assert seen[0].train.model.kind == "vlm"
    no_step = CliRunner().invoke(app, ["check-serving", "examples/vlm.yaml", "--model-dir", str(folder)])
    assert no_step.exit_code == 2 and "needs --step" in no_step.output, no_step.output
    assert len(seen) == 1


def test_a_vision_language_check_serves_the_given_folder_and_compares_with_its_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tasks.export.step
    import tasks.serve.server
    from tasks.serve.captioning import run_captioning_check
    from tests.integration.vlm_setup import save_vlm

    monkeypatch.delenv(KEY_ENV, raising=False)  # unsigned test checkpoints
    train, _ = save_vlm(tmp_path)  # checkpoint step 3

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("a given folder is served as it is, not exported")

    started: list[Path] = []

    def fake_start(folder: Path, *args: object, **kwargs: object) -> None:
        started.append(folder)
        raise _Stop

    monkeypatch.setattr(tasks.export.step, "export_checkpoint", no_export)
    monkeypatch.setattr(tasks.serve.server, "start_server", fake_start)
    serve = ServeConfig.model_validate({"check": {"parity_prompts": 2, "parity_tokens": 4, "quality_prompts": 2,
                                                  "output_tokens": 4}})  # fmt: skip
    given = tmp_path / "quantized" / "step-3"
    with pytest.raises(_Stop):  # our model of step 3 was loaded for parity before the server started
        run_captioning_check(serve, train, "cpu", "vlm", tmp_path / "serving", str(tmp_path / "export"), step=3,
                             model_dir=str(given))  # fmt: skip
    assert started == [given]
