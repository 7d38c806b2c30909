"""`tdeploy export --format onnx`: the checkpoint's model in ONNX Runtime, fp32 and int8, each with its parity.

The fp32 graph gives the checkpoint's logits (our Transformer's, not only transformers') on whole prompts and
through its KV cache; the int8 one stays within its bounds; a graph that loses the cache positions, or an int8
graph with a wrong scale, is refused and nothing is published; an unknown --format is one clear message.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.export import onnx as onnx_export
from tasks.export.onnx import (
    INT8_SUFFIX,
    ONNX_MODEL,
    Int8Bounds,
    OnnxCausalLM,
    OnnxExportError,
    export_onnx,
    measure_parity,
    require_onnx_parity,
)
from tasks.export.step import EXPORT_RECORD
from tasks.spec import DeploymentSpec, load_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.test_hf_export import bytes_card, save_checkpoints
from training.checkpoint import CheckpointManager
from training.model import Transformer

pytestmark = pytest.mark.integration
transformers = pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

STEP = 3
ONNX_FILES = {ONNX_MODEL, "model.onnx.data", "config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", EXPORT_RECORD}  # fmt: skip


@pytest.fixture(autouse=True)
def _quiet() -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    transformers.utils.logging.disable_progress_bar()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: str) -> tuple[Path, DeploymentSpec]:
    """A spec file whose checkpoint folder holds a random-initialised tiny model at step 3 (norm weights too)."""
    root = tmp_path_factory.mktemp("onnx")
    where = {"name": "onnx", "deployment_dir": str(root / "onnx"), "data": {"dataset_url": tiny_dataset}}
    data = deep_merge(TINY_SPEC, where)
    for section in ("checkpoint", "run"):
        data[section] = {k: v for k, v in data[section].items() if k not in ("url", "output_url")}
    path = root / "onnx.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(str(path))
    save_checkpoints(spec.training_config(), bytes_card(spec.model), STEP)
    return path, spec


@pytest.fixture(scope="module")
def exported(saved: tuple[Path, DeploymentSpec]) -> tuple[DeploymentSpec, str]:
    """`tdeploy export SPEC --format onnx` run once; the spec and the command's output."""
    path, spec = saved
    result = CliRunner().invoke(app, ["export", str(path), "--format", "onnx"], terminal_width=400)
    assert result.exit_code == 0, result.output
    return spec, result.output


def _dirs(spec: DeploymentSpec) -> tuple[Path, Path, Path]:
    hf = Path(spec.deployment_dir) / "export" / f"step-{STEP}"
    return hf, hf.with_name(hf.name + "-onnx"), hf.with_name(hf.name + "-onnx" + INT8_SUFFIX)


def _ours(spec: DeploymentSpec) -> Transformer:
    model = Transformer(spec.model)
    CheckpointManager(spec.checkpoint, spec.storage).load_model(STEP, model)
    return model.eval()


def _prompts(spec: DeploymentSpec) -> np.ndarray:
    """Token ids the export's parity never saw (its prompts come from the dataset): a fixed other seed."""
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, spec.model.vocab_size, (3, spec.model.seq_len), generator=generator).numpy()


def test_onnx_export_gives_the_checkpoints_logits_whole_and_through_the_kv_cache(exported) -> None:
    spec, output = exported
    hf, fp32, int8 = _dirs(spec)
    assert f"ONNX fp32: {fp32}" in output and f"ONNX int8: {int8}" in output, output
    assert {p.name for p in fp32.iterdir()} == ONNX_FILES
    ids = _prompts(spec)
    with torch.no_grad():
        expected = _ours(spec)(torch.from_numpy(ids))[0].numpy()
    runtime = OnnxCausalLM(fp32)
    scale = np.abs(expected).max()
    assert np.abs(runtime.logits(ids) - expected).max() <= 1e-4 + 1e-3 * scale
    # the cache path: half the prompt, then one token at a time
    half = ids.shape[1] // 2
    logits, cache = runtime.step(ids[:, :half], runtime.empty_cache(len(ids)))
    steps = [logits]
    for pos in range(half, ids.shape[1]):
        logits, cache = runtime.step(ids[:, pos : pos + 1], cache)
        steps.append(logits)
    assert np.abs(np.concatenate(steps, axis=1) - expected).max() <= 1e-4 + 1e-3 * scale
    # greedy generation as transformers does it on the Hugging Face folder
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    prompt = ids[0, :8].tolist()
    reference = loaded.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert runtime.greedy(prompt, 8) == reference[0, 8:].tolist()


def test_each_onnx_folder_records_its_parity_source_and_checksums(exported) -> None:
    spec, _ = exported
    hf, fp32, int8 = _dirs(spec)
    hf_record = json.loads((hf / EXPORT_RECORD).read_text())
    for folder, precision in ((fp32, "fp32"), (int8, "int8")):
        record = json.loads((folder / EXPORT_RECORD).read_text())
        assert record["format"] == "onnx" and record["precision"] == precision
        assert record["source"]["model_dir"] == str(hf) and record["source"]["step"] == STEP
        parity = record["parity"]
        assert parity["prompts_from"].startswith("split ") and parity["prompts"] == hf_record["parity"]["prompts"]
        assert parity["upstream_max_abs_logit_diff"] == hf_record["parity"]["max_abs_logit_diff"]
        assert set(record["files"]) | {EXPORT_RECORD} == {p.name for p in folder.iterdir()}
        assert (folder / ONNX_MODEL).stat().st_mode & 0o044 == 0o044  # readable by group and others (umask 022)
    fp32_parity = json.loads((fp32 / EXPORT_RECORD).read_text())["parity"]
    assert fp32_parity["max_abs_logit_diff"] <= fp32_parity["tolerance"]
    assert fp32_parity["decode_max_abs_logit_diff"] <= fp32_parity["tolerance"]


def test_int8_variant_is_smaller_and_within_its_bounds_of_the_checkpoint(exported) -> None:
    spec, _ = exported
    _, fp32, int8 = _dirs(spec)
    # the weights: int8 with a scale per output channel, a quarter of fp32's (plus the fp32 norms and scales)
    assert _weight_bytes(int8) < 0.4 * _weight_bytes(fp32)
    ids = _prompts(spec)
    with torch.no_grad():
        expected = _ours(spec)(torch.from_numpy(ids))[0].numpy()
    logits = OnnxCausalLM(int8).logits(ids)
    bounds = Int8Bounds()
    assert np.abs(logits - expected).max() <= bounds.max_rel_logit_error * np.abs(expected).max()
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() >= bounds.min_top1_agreement


def _weight_bytes(folder: Path) -> int:
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(folder / ONNX_MODEL))
    return sum(numpy_helper.to_array(init).nbytes for init in model.graph.initializer)


def _scale_one_weight(folder: Path, factor: float) -> str:
    """The fault: the output projection's per-channel weight scales (the longest: one per vocabulary entry) of the
    int8 graph multiplied by `factor`; the initializer's name."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(folder / ONNX_MODEL))
    scales = [init for init in model.graph.initializer if init.name.endswith("_scale") and len(init.dims) == 1]
    target = max(scales, key=lambda init: init.dims[0])
    target.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(target) * factor, target.name))
    onnx.save(model, str(folder / ONNX_MODEL))
    return target.name


def test_an_int8_graph_with_a_wrong_scale_is_out_of_bounds(exported, tmp_path: Path) -> None:
    spec, _ = exported
    hf, _, int8 = _dirs(spec)
    broken = tmp_path / "broken"
    shutil.copytree(int8, broken)
    record = json.loads((int8 / EXPORT_RECORD).read_text())["parity"]
    sound = measure_parity(broken, "int8", _prompts(spec).tolist(), "fixed", *_reference(hf, spec), Int8Bounds())
    assert sound.passed, sound
    # every logit doubled: the most likely token stays the same, so top-1 agreement alone would pass it
    assert _scale_one_weight(broken, 2.0)
    parity = measure_parity(broken, "int8", _prompts(spec).tolist(), "fixed", *_reference(hf, spec), Int8Bounds())
    assert parity.top1_agreement == sound.top1_agreement and not parity.passed
    assert parity.max_rel_logit_error > 10 * record["max_abs_logit_diff"] / record["max_abs_logit"]
    with pytest.raises(OnnxExportError, match=r"ONNX int8 parity failed for .*max \|logit error\| / max \|logit\|"):
        require_onnx_parity(parity, str(broken))


def _reference(hf: Path, spec: DeploymentSpec) -> tuple[np.ndarray, str]:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        return loaded(torch.from_numpy(_prompts(spec))).logits.numpy(), "transformers"


def test_a_graph_that_loses_the_cache_positions_is_refused_and_nothing_is_published(
    exported, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec, _ = exported
    hf, _, _ = _dirs(spec)
    real = onnx_export._decoder_with_cache

    def positions_from_zero(model):  # the fault: every call's positions start at 0, cache or not
        wrapped = real(model)
        forward = wrapped.forward
        wrapped.forward = lambda ids, mask, positions, past: forward(ids, mask, positions - positions[:, :1], past)
        return wrapped

    monkeypatch.setattr(onnx_export, "_decoder_with_cache", positions_from_zero)
    out = tmp_path / "onnx"
    prompts = _prompts(spec).tolist()
    with pytest.raises(OnnxExportError, match=r"ONNX fp32 parity failed .*through the KV cache: max \|logit diff\|"):
        export_onnx(hf, prompts, "fixed", str(out))
    assert list(tmp_path.iterdir()) == []  # neither folder, nor a partial one


def test_export_with_an_unknown_format_exits_2_naming_the_formats(saved) -> None:
    path, spec = saved
    before = sorted(Path(spec.deployment_dir).rglob("*"))
    result = CliRunner().invoke(app, ["export", str(path), "--format", "tflite"], terminal_width=400)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "export failed: --format=tflite: not an export format; use one of hf, onnx" in text, text
    assert "Traceback" not in result.output and sorted(Path(spec.deployment_dir).rglob("*")) == before


def test_an_moe_folder_is_refused_naming_the_architecture_and_nothing_is_written(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
    )  # fmt: skip
    transformers.MixtralForCausalLM(config).save_pretrained(str(tmp_path / "moe"))
    with pytest.raises(OnnxExportError, match=r"architecture=MixtralForCausalLM: the ONNX export covers dense"):
        export_onnx(tmp_path / "moe", [[1, 2, 3, 4]], "fixed", str(tmp_path / "onnx"))
    assert {p.name for p in tmp_path.iterdir()} == {"moe"}
