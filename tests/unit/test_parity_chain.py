"""The parity chain of the serving report: each hop's figures read from the record its step wrote (EXPORT.json's
load-time check, the quantize gate's quantization.json, the serving check's own), in order, each against its
tolerance; a hop without its record is named as missing, never invented. And the served hop's log-probability
comparison: our model's prompt log-probabilities as the server's prompt_logprobs give them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tasks.paths import EXPORT_RECORD, QUANTIZE_RECORD
from tasks.serve.chain import chain_rows, parity_chain
from tasks.serve.check import our_logprobs
from training.config import ModelConfig
from training.model import Transformer
from validation.serving import LogprobFigures, ParityFigures, logprob_deviation

SERVED = ParityFigures(prompts=4, tokens=8, matched=3)
LOGPROBS = LogprobFigures(prompts=4, tokens=124, max_abs_diff=0.02, mean_abs_diff=0.004)


def _export(folder: Path, diff: float, tolerance: float = 1e-4) -> Path:
    folder.mkdir(parents=True)
    parity = {"prompts": 4, "prompt_tokens": 64, "prompts_from": "the dataset's val split", "tolerance": tolerance,
              "max_abs_logit_diff": diff, "config_mismatches": [], "worst_tensor": None}  # fmt: skip
    (folder / EXPORT_RECORD).write_text(json.dumps({"step": 4, "parity": parity}))
    return folder


def _quantized(folder: Path, source: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / QUANTIZE_RECORD).write_text(json.dumps({"source": {"model_dir": str(source)}, "scheme": "W8A8"}))
    return folder


def _gate_report(path: Path, quantized: Path, increase: float, agreement: float) -> Path:
    checks = [
        {"name": "perplexity_increase", "value": increase, "bound": 0.05, "passed": increase <= 0.05, "message": ""},
        {"name": "greedy_agreement", "value": agreement, "bound": 0.9, "passed": agreement >= 0.9, "message": ""},
        {"name": "weight_bytes_ratio", "value": 0.4, "bound": None, "passed": None, "message": ""},
    ]
    report = {"quantized": {"model_dir": str(quantized), "scheme": "W8A8", "method": "gptq"}, "checks": checks,
              "base": {"perplexity": 10.0}, "measured": {"perplexity": 10.0 * (1 + increase), "eval_tokens": 2016}}  # fmt: skip
    path.write_text(json.dumps(report))
    return path


def test_a_quantized_folder_has_every_hop_in_order_each_read_from_its_own_record(tmp_path: Path) -> None:
    export = _export(tmp_path / "export" / "step-4", diff=3e-6)
    quantized = _quantized(tmp_path / "export" / "step-4-w8a8-gptq", export)
    gate = _gate_report(tmp_path / "quantization.json", quantized, increase=-0.0002, agreement=0.94)

    chain = parity_chain(quantized, gate, SERVED, LOGPROBS, 0.5, tmp_path / "serving.json")

    assert [(h.hop, h.measure) for h in chain.hops] == [
        ("training -> export", "max |logit difference|"),
        ("export -> quantized (W8A8, gptq)", "perplexity increase"),
        ("export -> quantized (W8A8, gptq)", "next tokens predicted alike (teacher-forced)"),
        ("quantized -> served", "greedy prompts identical"),
        ("quantized -> served", "max |log-probability difference|"),
    ]
    figures = [(h.measured, h.tolerance, h.passed) for h in chain.hops]
    assert figures == [(3e-6, 1e-4, True), (-0.0002, 0.05, True), (0.94, 0.9, True), (0.75, 0.5, True),
                       (0.02, None, None)]  # fmt: skip
    assert chain.hops[0].source == str(export / EXPORT_RECORD) and chain.hops[1].source == str(gate)
    assert chain.passed and not chain.missing
    rows = chain_rows(chain)
    assert rows[1]["tolerance"] == "<= 0.05" and rows[2]["tolerance"] == ">= 0.9" and rows[4]["verdict"] == "figure"


def test_a_hop_over_its_tolerance_fails_the_chain_and_a_hop_without_its_record_is_named_missing(
    tmp_path: Path,
) -> None:
    export = _export(tmp_path / "step-4", diff=0.64)  # a swapped k/v projection, had it been published
    chain = parity_chain(export, None, SERVED, LOGPROBS, 0.5, tmp_path / "serving.json")
    assert [h.passed for h in chain.hops] == [False, True, None] and not chain.passed
    assert chain.hops[1].hop == "export -> served"

    quantized = _quantized(tmp_path / "step-4-w8a8-rtn", export)
    without_gate = parity_chain(quantized, None, SERVED, LOGPROBS, 0.5, tmp_path / "serving.json")
    assert [h.hop for h in without_gate.hops] == ["training -> export", "quantized -> served", "quantized -> served"]
    assert len(without_gate.missing) == 1 and "served without its gate's report" in without_gate.missing[0]
    assert chain_rows(without_gate)[-1]["verdict"] == "missing"

    other = _gate_report(tmp_path / "other.json", tmp_path / "another-folder", increase=0.0, agreement=1.0)
    mismatched = parity_chain(quantized, other, SERVED, LOGPROBS, 0.5, tmp_path / "serving.json")
    assert "is the gate of" in mismatched.missing[0] and len(mismatched.hops) == 3

    old = tmp_path / "old-export"
    old.mkdir()
    (old / EXPORT_RECORD).write_text(json.dumps({"step": 4}))  # exported before load-time checks
    unchecked = parity_chain(old, None, SERVED, LOGPROBS, 0.5, tmp_path / "serving.json")
    assert "holds no load-time check" in unchecked.missing[0] and unchecked.hops[0].hop == "export -> served"


def test_our_prompt_logprobs_score_each_token_after_its_prefix_as_the_server_does() -> None:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=2, ffn_hidden=64, vocab_size=50, seq_len=16))
    model.eval()
    prompt = [3, 7, 11, 2, 9]
    ours = our_logprobs(model, [prompt])[0]
    assert len(ours) == len(prompt) - 1
    with torch.no_grad():  # the third token scored alone: the model run on its prefix only
        logits, _ = model(torch.tensor([prompt[:3]]))
    assert ours[2] == pytest.approx(torch.log_softmax(logits[0, -1], -1)[prompt[3]].item(), abs=1e-5)
    figures = logprob_deviation([ours], [[x + 0.01 * k for k, x in enumerate(ours)]])
    assert (figures.tokens, figures.max_abs_diff) == (4, pytest.approx(0.03)) and figures.mean_abs_diff > 0
