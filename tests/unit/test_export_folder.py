"""What users of an exported folder expect: batched tokenisation with padding and `generate(max_new_tokens=...)`
without warnings, files other users can read, a model card, and the dtype to serve in recorded and used."""

from __future__ import annotations

import json
import logging
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from tasks.acceptance.record import AcceptanceReport
from tasks.export.readme import README, AcceptanceFigures
from tasks.export.step import EXPORT_RECORD, export_checkpoint
from tasks.serve.config import ServeConfig
from tasks.serve.server import server_args, with_folder_dtype
from tests.unit.test_hf_export import DENSE_GQA, TIED, bytes_card, model_config, save_checkpoints, train_config
from training.checkpoint import KEY_ENV
from training.config import TrainConfig
from validation.acceptance import DimensionResult

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _unsigned(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)  # unsigned test checkpoints


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def transformers_warnings() -> list[str]:
    """What transformers logs at WARNING and above (its loggers do not propagate to the root logger)."""
    transformers.utils.logging.disable_progress_bar()
    handler = _Collect()
    library = transformers.utils.logging.get_logger("transformers")
    library.addHandler(handler)
    yield handler.messages
    library.removeHandler(handler)


def _with_precision(train: TrainConfig, dtype: str) -> TrainConfig:
    return train.model_copy(update={"precision": train.precision.model_copy(update={"dtype": dtype})})


def test_the_folder_pads_a_batch_and_generates_with_max_new_tokens_without_warnings(
    tmp_path: Path, transformers_warnings: list[str]
) -> None:
    cfg = model_config(DENSE_GQA)
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)
    folder = Path(export_checkpoint(train, out=tmp_path / "hf").model_dir)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert "max_length" not in generation and generation["pad_token_id"] == 256
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.pad_token_id == 256 and tokenizer.padding_side == "left"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch = tokenizer(["ab", "a longer"], return_tensors="pt", padding=True)
        out = model.generate(**batch, max_new_tokens=5)
    assert batch["input_ids"].shape == (2, 8) and batch["input_ids"][0, 0].item() == 256
    assert batch["attention_mask"][0].tolist() == [0] * 6 + [1, 1]  # left-padded
    assert out.shape == (2, 8 + 5)  # within seq_len 16
    assert [str(w.message) for w in caught] == []
    assert transformers_warnings == []


@pytest.mark.parametrize(("umask", "file_mode", "dir_mode"), [(0o022, 0o644, 0o755), (0o077, 0o600, 0o700)])
def test_the_folder_is_readable_by_others_as_far_as_the_umask_allows(
    tmp_path: Path, umask: int, file_mode: int, dir_mode: int
) -> None:
    cfg = model_config(TIED)
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 2)
    previous = os.umask(umask)
    try:
        folder = Path(export_checkpoint(train, out=tmp_path / "hf").model_dir)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == dir_mode
    modes = {path.name: stat.S_IMODE(path.stat().st_mode) for path in folder.iterdir()}
    assert modes == dict.fromkeys(modes, file_mode) and EXPORT_RECORD in modes and README in modes


def _front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def test_the_model_card_names_library_task_base_model_dataset_and_the_acceptance_figures(tmp_path: Path) -> None:
    cfg = model_config(DENSE_GQA).model_copy(update={"init_from": "/models/base-llama"})
    train = train_config(tmp_path, cfg)
    save_checkpoints(train, bytes_card(cfg), 3)
    dimensions = [
        DimensionResult(name="quality", passed=True, measured={"val_loss": 2.3456, "start_val_loss": 3.1}),
        DimensionResult(name="correctness", passed=False, measured={"max_rel_deviation": 0.5}),
    ]
    AcceptanceReport(dimensions=dimensions).write(tmp_path / "workspace")
    report = AcceptanceReport.read(tmp_path / "workspace")
    result = export_checkpoint(train, out=tmp_path / "hf", acceptance=AcceptanceFigures.of(report))
    text = (Path(result.model_dir) / README).read_text()
    meta = _front_matter(text)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-generation"
    assert meta["base_model"] == "/models/base-llama" and meta["datasets"] == ["/d"]
    assert "## Training figures (acceptance: failed)" in text
    assert "| quality | passed | val_loss=2.346, start_val_loss=3.1 |" in text
    assert "| correctness | failed | max_rel_deviation=50% |" in text  # a relative figure, in percent
    assert f"(tolerance {result.parity.tolerance:.2g}) on {result.parity.prompts} prompts" in text
    assert README in result.files

    plain_cfg = model_config(DENSE_GQA)
    plain_train = train_config(tmp_path / "plain", plain_cfg)
    save_checkpoints(plain_train, bytes_card(plain_cfg), 3)
    plain = (Path(export_checkpoint(plain_train, out=tmp_path / "plain" / "hf").model_dir) / README).read_text()
    assert "base_model" not in _front_matter(plain) and "Training figures" not in plain


@pytest.mark.parametrize(("precision", "served"), [("fp32", "float32"), ("bf16", "bfloat16")])
def test_the_serving_dtype_is_the_runs_and_the_server_takes_it_unless_the_spec_names_one(
    tmp_path: Path, precision: str, served: str
) -> None:
    cfg = model_config(TIED)
    train = _with_precision(train_config(tmp_path, cfg), precision)
    save_checkpoints(train, bytes_card(cfg), 2)
    result = export_checkpoint(train, out=tmp_path / "hf")
    folder = Path(result.model_dir)
    config = json.loads((folder / "config.json").read_text())
    record = json.loads((folder / EXPORT_RECORD).read_text())
    assert config["torch_dtype"] == config["dtype"] == served
    assert record["serving_dtype"] == result.serving_dtype == served
    assert f"--dtype {served}" in (folder / README).read_text()

    args = server_args(with_folder_dtype(ServeConfig(), folder), "m", str(folder), "cpu")
    assert args[args.index("--dtype") + 1] == served
    stated = server_args(with_folder_dtype(ServeConfig(dtype="float16"), folder), "m", str(folder), "cpu")
    assert stated[stated.index("--dtype") + 1] == "float16"


@pytest.mark.parametrize(
    ("config", "served"),
    [({"torch_dtype": "bfloat16"}, "bfloat16"), ({"dtype": "float16"}, "float16"), ({}, "float32"),
     ({"torch_dtype": "float64"}, "float32")],
)  # fmt: skip
def test_a_folder_that_names_no_servable_dtype_is_served_in_float32_never_downcast(
    tmp_path: Path, config: dict, served: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    args = server_args(with_folder_dtype(ServeConfig(), tmp_path), "m", str(tmp_path), "cpu")
    assert args[args.index("--dtype") + 1] == served


def test_the_commands_and_the_flow_give_the_model_card_the_deployments_latest_acceptance_figures(
    make_spec, tmp_path: Path
) -> None:
    from flows.cli.data import model_card_figures
    from tasks.acceptance.record import latest_card
    from tasks.acceptance.workspace import mark_latest, open_workspace
    from tasks.paths import DeploymentPaths
    from tasks.run_id import new_run_id

    spec = make_spec(name="card")
    base = DeploymentPaths.of(spec).acceptance_workspaces
    assert latest_card(base) is None and model_card_figures(spec) is None  # before the first acceptance run
    workspace = open_workspace(base / new_run_id(), keep=3)
    dimensions = [DimensionResult(name="quality", passed=True, measured={"val_loss": 2.5})]
    AcceptanceReport(dimensions=dimensions).write(workspace.root)
    mark_latest(workspace)
    card = model_card_figures(spec)
    assert card == latest_card(base) and card is not None
    assert card.passed and card.dimensions == [("quality", "passed", "val_loss=2.5")]
    AcceptanceReport.path_in(workspace.root).write_text("{not json")
    assert latest_card(base) is None  # left out of the card (logged); the export goes on
