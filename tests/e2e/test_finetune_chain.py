"""examples/finetune.yaml end to end: `tdeploy run` goes from a Hugging Face model (examples/models/tiny-llama) to a
served, quantized, fine-tuned model with every hop's parity in the report.

The base model's logits are checked against transformers' before the first step (init_check.json), the data is
tokenized with its own tokenizer, acceptance holds the fine-tuned model to the starting model's validation loss,
the export is loaded back by transformers and compared, LLM Compressor's W8A8 folder passes its gate served by
vLLM, and the serving check serves that folder with serving.json's chain naming every hop.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tasks.launch.torchrun import free_port
from tasks.paths import QUANTIZE_RECORD
from tests.conftest import REPO
from tests.processes import run_group
from training.hf_load import HF_INIT_CHECK, read_init_check, tolerance
from training.run_output import RunOutput

pytestmark = pytest.mark.e2e

BASE = REPO / "examples" / "models" / "tiny-llama"


def test_a_hugging_face_model_is_fine_tuned_accepted_quantized_and_served_with_every_hops_parity(
    tmp_path: Path,
) -> None:
    data = yaml.safe_load((REPO / "examples" / "finetune.yaml").read_text())
    # the example's paths are relative to the repository root; this run is in its own folder
    data["model"]["init_from"] = str(BASE)
    data["data"]["prepare"]["tokenizer"]["path"] = str(BASE / "tokenizer.json")
    data["serve"]["port"] = free_port()
    spec = tmp_path / "finetune.yaml"
    spec.write_text(yaml.safe_dump(data))
    tdeploy = shutil.which("tdeploy", path=str(Path(sys.executable).parent))

    proc = run_group([tdeploy, "run", str(spec)], timeout=2400, cwd=tmp_path)

    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    runs = tmp_path / "runs" / "finetune"
    summary = json.loads((runs / "summary.json").read_text())
    assert summary["failed_step"] is None, summary

    # the main job started from the base model, checked against transformers' logits before its first step
    check = read_init_check(str(runs / "output" / HF_INIT_CHECK))
    assert check.source == str(BASE)
    deviations = [r["init_check_deviation"] for r in RunOutput(str(runs / "output")).ranks().ranks]
    assert len(deviations) == 2 and max(deviations) <= tolerance(check.logits), deviations

    # acceptance: the fine-tune is held to the starting model's validation loss
    root = Path(json.loads((runs / "acceptance" / "latest.json").read_text())["root"])
    acceptance = json.loads((root / "acceptance.json").read_text())
    assert acceptance["verdict"] == "passed", acceptance
    quality = next(d for d in acceptance["dimensions"] if d["name"] == "correctness")["measured"]["quality"]
    assert quality["rule"] == "init_from", quality

    # the quantize gate passed on the fine-tuned export: the quantized folder beside the export, naming it
    gate = json.loads((runs / "quantize" / "quantization.json").read_text())
    assert gate["verdict"] == "passed" and gate["quantized"]["scheme"] == "W8A8", gate["checks"]
    step = gate["step"]
    # report paths are relative to where tdeploy ran, like every report path (tmp_path / an absolute one is itself)
    assert tmp_path / gate["base"]["model_dir"] == runs / "export" / f"step-{step}"
    quantized = tmp_path / gate["quantized"]["model_dir"]
    assert quantized == runs / "export" / f"step-{step}-w8a8-gptq"
    source = json.loads((quantized / QUANTIZE_RECORD).read_text())["source"]["model_dir"]
    assert source == str((runs / "export" / f"step-{step}").resolve())
    for side in ("base", "measured"):
        assert gate[side]["perplexity"] > 1 and gate[side]["eval_tokens"] == 16 * 47, gate[side]
        assert gate[side]["p99_e2e_ms"] > 0 and gate[side]["output_tokens_per_s"] > 0, gate[side]
    assert gate["measured"]["weight_bytes"] < gate["base"]["weight_bytes"]
    assert (runs / "quantize" / "quantize.log").is_file() and (runs / "quantize" / "unquantized" / "server.log").is_file()
    card = (tmp_path / gate["base"]["model_dir"] / "README.md").read_text()
    assert f"base_model: {BASE}" in card and "## Training figures (acceptance: passed)" in card, card

    # the serving check served the quantized folder; its chain has every hop, each within its tolerance
    serving = json.loads((runs / "serving" / "serving.json").read_text())
    assert serving["verdict"] == "passed" and serving["model_dir"] == gate["quantized"]["model_dir"], serving["checks"]
    chain = serving["chain"]
    assert [(h["hop"], h["measure"]) for h in chain["hops"]] == [
        ("training -> export", "max |logit difference|"),
        ("export -> quantized (W8A8, gptq)", "perplexity increase"),
        ("export -> quantized (W8A8, gptq)", "next tokens predicted alike (teacher-forced)"),
        ("quantized -> served", "greedy prompts identical"),
        ("quantized -> served", "max |log-probability difference|"),
    ], chain
    assert chain["passed"] and not chain["missing"] and all(h["passed"] is not False for h in chain["hops"]), chain
    print("parity chain: " + "; ".join(f"{h['hop']} {h['measure']} {h['measured']:.4g}" for h in chain["hops"]))
