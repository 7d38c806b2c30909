"""`tdeploy export` on a real training run: the Hugging Face folder gives our logits under transformers; a
missing step or an empty checkpoint folder is one clear message (exit 2); checkpoints on S3 export too."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.export.step import EXPORT_RECORD, export_checkpoint
from tasks.launch.local import run_local
from tasks.spec import DeploymentSpec, load_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.checkpoint import CheckpointManager
from training.model import Transformer
from training.storage import StorageConfig

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")

# head_dim 32 (d_model 64 / 2 heads, one KV head): the shape of examples/local.yaml's model
MODEL = {"d_model": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 96}
HF_FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"
}  # fmt: skip


def _spec_file(root: Path, name: str, dataset: str, overrides: dict[str, Any] | None = None) -> Path:
    """A tiny spec in its own deployment folder (root/name: checkpoints/, output/, export/ derived)."""
    data = deep_merge(TINY_SPEC, {"name": name, "deployment_dir": str(root / name), "data": {"dataset_url": dataset}})
    for section in ("checkpoint", "run"):
        data[section] = {k: v for k, v in data[section].items() if k not in ("url", "output_url")}
    data = deep_merge(data, overrides or {})
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> tuple[Path, DeploymentSpec]:
    """A spec file and its spec after a 4-step run on 2 ranks with checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("export")
    overrides = {"model": MODEL, "run": {"steps": 4, "log_every_steps": 2}, "checkpoint": {"save_every_steps": 2}}
    path = _spec_file(root, "trained", tiny_dataset, overrides)
    spec = load_spec(str(path))
    run_local(spec.cluster, spec.training_config())
    return path, spec


def _ours(spec: DeploymentSpec, step: int) -> Transformer:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model = Transformer(spec.model)
    CheckpointManager(spec.checkpoint, spec.storage).load_model(step, model)
    return model.eval()


def _max_logit_diff(model_dir: str | Path, ours: Transformer, seed: int = 0) -> float:
    transformers.utils.logging.disable_progress_bar()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    text = "def export(spec):\n    return folder  # the tokenizer encodes this as bytes"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = torch.tensor([tokenizer.encode(text)[: ours.cfg.seq_len]])
    assert ids[0].tolist() == list(text.encode())[: ours.cfg.seq_len]
    with torch.no_grad():
        return (loaded(ids).logits - ours(ids)[0]).abs().max().item()


def test_tdeploy_export_writes_a_folder_that_transformers_runs_with_our_logits(trained) -> None:
    path, spec = trained
    result = CliRunner().invoke(app, ["export", str(path), "--step", "2"], terminal_width=400)
    assert result.exit_code == 0, result.output
    folder = Path(spec.deployment_dir) / "export" / "step-2"
    assert "exported step 2 as LlamaForCausalLM" in result.output and str(folder) in result.output
    assert set(p.name for p in folder.iterdir()) == HF_FILES | {EXPORT_RECORD}
    for name in HF_FILES:
        assert f"  {name}" in result.output
    record = json.loads((folder / EXPORT_RECORD).read_text())
    assert record["source"]["step"] == 2 and record["card"]["model"] == spec.model.model_dump(mode="json")
    diff = _max_logit_diff(folder, _ours(spec, 2))
    assert diff < 1e-5, diff

    newest = export_checkpoint(spec.training_config(), out=Path(spec.deployment_dir) / "newest")
    assert newest.step == 4 and _max_logit_diff(newest.model_dir, _ours(spec, 4)) < 1e-5


def test_the_export_checks_its_logits_on_the_datasets_held_out_split_and_records_them(
    trained, tmp_path: Path
) -> None:
    _, spec = trained
    train = spec.training_config()
    result = export_checkpoint(train, step=4, out=tmp_path / "hf")
    parity = result.parity
    assert parity is not None and parity.passed
    assert parity.prompts_from == f"split {train.data.val_split!r} of {train.data.dataset_url}"
    record = json.loads((tmp_path / "hf" / EXPORT_RECORD).read_text())
    assert record["parity"]["max_abs_logit_diff"] == parity.max_abs_logit_diff <= parity.tolerance
    assert record["serving_dtype"] == "float32"  # the tiny spec trains in fp32 on CPU


def test_export_of_a_step_that_does_not_exist_exits_2_naming_the_steps_there(trained) -> None:
    path, spec = trained
    result = CliRunner().invoke(app, ["export", str(path), "--step", "3"], terminal_width=400)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"export failed: step=3: no checkpoint of that step under {spec.checkpoint.url}" in text, text
    assert "(committed steps: 2, 4)" in text and "Traceback" not in result.output
    assert not (Path(spec.deployment_dir) / "export" / "step-3").exists()


def test_export_tokenizer_option_reaches_the_export_and_is_refused_for_a_run_with_its_own(
    trained, tmp_path: Path
) -> None:
    path, spec = trained
    given = tmp_path / "tokenizer.json"
    given.write_text("{}")
    out = tmp_path / "hf"
    result = CliRunner().invoke(app, ["export", str(path), "--out", str(out), "--tokenizer", str(given)])
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"--tokenizer={given}: checkpoint step 4 was trained with its dataset's own tokenizer (bytes)" in text, text
    assert "leave --tokenizer out" in text and "Traceback" not in result.output and not out.exists()


def test_export_without_any_checkpoint_exits_2_naming_the_folder(tmp_path: Path, tiny_dataset: str) -> None:
    path = _spec_file(tmp_path, "untrained", tiny_dataset)
    result = CliRunner().invoke(app, ["export", str(path)], terminal_width=400)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    folder = tmp_path / "untrained" / "checkpoints"
    assert f"export failed: checkpoint.url={folder}: no checkpoint there" in text, text
    assert "tdeploy train" in text and "Traceback" not in result.output


def test_a_checkpoint_on_s3_exports_to_s3(trained, s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    import fsspec

    _, spec = trained
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    fs = fsspec.filesystem("s3", **storage.fsspec_options("s3://"))
    fs.put(spec.checkpoint.url.rstrip("/") + "/", f"{s3_bucket}/ckpt/", recursive=True)
    train = spec.training_config().model_copy(
        update={"checkpoint": spec.checkpoint.model_copy(update={"url": f"s3://{s3_bucket}/ckpt"}), "storage": storage}
    )
    result = export_checkpoint(train, step=4)
    assert result.model_dir == f"s3://{s3_bucket}/export/step-4" and result.checkpoint_dir.startswith("s3://")
    fs.get(f"{s3_bucket}/export/step-4/", str(tmp_path / "hf") + "/", recursive=True)
    assert {p.name for p in (tmp_path / "hf").iterdir()} == HF_FILES | {EXPORT_RECORD}
    assert _max_logit_diff(tmp_path / "hf", _ours(spec, 4)) < 1e-5


@pytest.mark.usefixtures("prefect_harness")
def test_the_export_task_retries_a_storage_outage_and_publishes_the_folder(
    trained, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from uuid import UUID

    from prefect import flow
    from prefect.client.orchestration import get_client

    import tasks.export.task as export_task
    from tasks.errors import TransientError
    from tasks.export.step import ExportInputs

    _, spec = trained
    calls: list[int | None] = []
    real = export_task.run

    def flaky(inputs: ExportInputs) -> Any:
        calls.append(inputs.step)
        if len(calls) == 1:
            raise TransientError("checkpoint storage unreachable", "run the export again")
        return real(inputs)

    monkeypatch.setattr(export_task, "run", flaky)

    @flow
    def export_flow() -> dict[str, Any]:
        inputs = ExportInputs(train=spec.training_config(), step=2, out=str(tmp_path / "hf"))
        state = export_task.export_model.with_options(retry_delay_seconds=0)(inputs, return_state=True)
        return {"id": str(state.state_details.task_run_id), "result": state.result()}

    out = export_flow()
    with get_client(sync_client=True) as client:
        run_count = client.read_task_run(UUID(out["id"])).run_count
        artifacts = [a for a in client.read_artifacts() if a.key == "export"]
    assert run_count == 2 and calls == [2, 2]
    assert out["result"].step == 2 and out["result"].model_dir == str(tmp_path / "hf")
    assert any(str(tmp_path / "hf") in (a.data or "") for a in artifacts)
