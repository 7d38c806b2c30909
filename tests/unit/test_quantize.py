"""The quantize section, the gate's arithmetic and the quantizer's refusals, without servers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.errors import UserError
from tasks.quantize.config import QuantizeConfig
from tasks.quantize.quantizer import EXPORT_RECORD, QUANT_PYTHON_ENV, quant_python, quantize_folder
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from validation.quantization import ServedModelFigures, greedy_agreement, judge_quantization, perplexity

# head_dim 32: a model vLLM's CPU attention serves
SERVABLE = {"model": {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 256, "seq_len": 128}}


def spec_data(overrides: dict[str, Any]) -> dict[str, Any]:
    return deep_merge(deep_merge(TINY_SPEC, SERVABLE), overrides)


def test_a_quantize_section_without_a_serve_section_is_refused_naming_the_fix() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_data({"quantize": {}}), "test")
    assert any("quantize" in p and "add `serve: {}`" in p for p in err.value.problems), err.value.problems


def test_a_scheme_vllm_cpu_cannot_serve_in_fp32_is_refused_with_the_dtype_that_works() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_data({"serve": {}, "quantize": {"scheme": "W4A16"}}), "test")
    (problem,) = [p for p in err.value.problems if p.startswith("quantize.scheme")]
    assert "W4A16" in problem and "set serve.dtype to bfloat16" in problem and "use scheme W8A8" in problem


def test_a_gpu_only_scheme_is_refused_on_a_cpu_cluster() -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_data({"serve": {}, "quantize": {"scheme": "FP8_DYNAMIC"}}), "test")
    assert any("FP8_DYNAMIC" in p and "GPU only" in p for p in err.value.problems), err.value.problems


def test_w8a8_and_w4a16_in_bf16_are_accepted_on_cpu() -> None:
    assert parse_spec(spec_data({"serve": {}, "quantize": {}}), "test").quantize == QuantizeConfig()
    spec = parse_spec(spec_data({"serve": {"dtype": "bfloat16"}, "quantize": {"scheme": "W4A16"}}), "test")
    assert spec.quantize is not None and spec.quantize.scheme == "W4A16"


def test_perplexity_sequences_leave_room_in_the_served_context_for_the_token_a_scoring_request_generates() -> None:
    # vLLM answered HTTP 400 to a 64-token prompt_logprobs request with max_tokens 1 at max_model_len 64
    with pytest.raises(SpecError) as err:
        parse_spec(spec_data({"serve": {"max_model_len": 64}, "quantize": {"eval_tokens": 64}}), "test")
    (problem,) = [p for p in err.value.problems if p.startswith("quantize.eval_tokens")]
    assert "served context 64; use at most 63" in problem
    spec = parse_spec(spec_data({"serve": {"max_model_len": 64}, "quantize": {"eval_tokens": 63}}), "test")
    assert spec.quantize is not None and spec.quantize.eval_tokens == 63


def test_perplexity_is_the_exponential_of_the_mean_negative_log_probability() -> None:
    value, tokens = perplexity([[-1.0, -2.0], [-3.0]])
    assert tokens == 3
    assert value == pytest.approx(2.718281828459045**2)


def test_greedy_agreement_counts_equal_tokens_position_by_position() -> None:
    figures = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7]], tokens=4)
    assert (figures.matched, figures.tokens, figures.prompts_identical) == (6, 8, 1)
    assert figures.share == 0.75


def test_one_near_tie_flipped_early_costs_one_position_not_the_rest_of_the_continuation() -> None:
    """Measured in CI: a W8A8 model of unchanged perplexity (-0.12%) flipped a near-tie at its second greedy token
    and continued its own way; compared free-running, 15 of its 16 tokens differed and the gate failed. Teacher-
    forced along the unquantized continuation, the flip is one position; prompts continued identically on their
    own are still counted."""
    reference = [[199, 199, 452, 341, 415, 77, 471, 2, 292, 261, 341, 415, 68, 278, 277, 70]]
    free = [[199] * 16]  # the quantized model's own continuation after the flip at position 2
    forced = [list(reference[0])]
    forced[0][2] = 199  # given the reference's prefix it differs only where the near-tie flipped
    figures = greedy_agreement(reference, forced, tokens=16, free=free)
    assert (figures.matched, figures.tokens, figures.prompts_identical) == (15, 16, 0)
    assert greedy_agreement(reference, free, tokens=16).matched == 2  # what the free-running count gave


def _figures(ppl: float, greedy: list[list[int]], p99: float = 10.0, rss: int | None = 100) -> ServedModelFigures:
    return ServedModelFigures("m", ppl, 64, greedy, p99, 100.0, rss, 1000)


def test_the_gate_fails_a_perplexity_increase_beyond_its_bound_and_reports_ratios() -> None:
    base = _figures(2.0, [[1, 2, 3, 4]])
    worse = _figures(2.2, [[1, 2, 3, 4]], p99=20.0, rss=None)
    checks = {c.name: c for c in judge_quantization(base, worse, greedy_agreement(base.greedy, worse.greedy, 4),
                                                    max_ppl_increase=0.05, min_greedy_agreement=0.9)}  # fmt: skip
    assert checks["perplexity_increase"].passed is False
    assert checks["perplexity_increase"].value == pytest.approx(0.1)
    assert checks["greedy_agreement"].passed is True
    assert checks["p99_e2e_ratio"].value == pytest.approx(2.0) and checks["p99_e2e_ratio"].passed is None
    assert checks["server_rss_ratio"].value is None  # unread memory is a figure of its own, never a failure


def test_the_gate_fails_greedy_agreement_below_its_bound() -> None:
    base = _figures(2.0, [[1, 2, 3, 4]])
    other = _figures(2.0, [[1, 2, 9, 9]])
    checks = {c.name: c for c in judge_quantization(base, other, greedy_agreement(base.greedy, other.greedy, 4),
                                                    max_ppl_increase=0.05, min_greedy_agreement=0.9)}  # fmt: skip
    assert checks["greedy_agreement"].passed is False and checks["greedy_agreement"].value == 0.5


def test_a_folder_that_is_not_a_finished_export_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UserError, match="no EXPORT.json; not a finished export"):
        quantize_folder(tmp_path, QuantizeConfig(), [])


def test_a_folder_that_is_not_an_earlier_quantization_is_not_replaced(tmp_path: Path) -> None:
    src = tmp_path / "step-1"
    src.mkdir()
    (src / EXPORT_RECORD).write_text(json.dumps({"format_version": 1}))
    taken = tmp_path / "step-1-w8a8-gptq"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a quantized folder"):
        quantize_folder(src, QuantizeConfig(), [])
    assert (taken / "notes.txt").read_text() == "mine"


def test_a_missing_quantization_environment_names_the_variable_and_the_setup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(QUANT_PYTHON_ENV, str(tmp_path / "nothing" / "python"))
    with pytest.raises(UserError, match=f"{QUANT_PYTHON_ENV}=.*bash .ci/setup"):
        quant_python()


def test_tdeploy_quantize_without_a_quantize_section_exits_with_a_user_error(tmp_path: Path) -> None:
    import yaml

    spec = tmp_path / "spec.yaml"
    paths = {"data": {"dataset_url": str(tmp_path / "data")}, "deployment_dir": str(tmp_path / "run")}
    spec.write_text(yaml.safe_dump(spec_data(paths)))
    result = CliRunner().invoke(app, ["quantize", str(spec)])
    assert result.exit_code == 2, result.output
    assert "no quantize section" in result.output


def test_the_quantize_result_summarises_the_gate_and_survives_a_json_round_trip() -> None:
    from tasks.quantize.gate import QuantizationReport
    from tasks.quantize.quantizer import QuantizedFolder
    from tasks.quantize.step import QuantizeResult

    base = _figures(2.0, [[1, 2, 3, 4]])
    quantized = _figures(2.02, [[1, 2, 3, 4]], p99=12.0)
    agreement = greedy_agreement(base.greedy, quantized.greedy, 4)
    checks = judge_quantization(base, quantized, agreement, max_ppl_increase=0.05, min_greedy_agreement=0.9)
    folder = QuantizedFolder("runs/t/export/step-9-w8a8-gptq", "runs/t/export/step-9", "W8A8", "gptq", 400, 1000, 1.0)
    report = QuantizationReport(folder, 9, "val", base, quantized, agreement, checks, {"json": "q/quantization.json"})
    result = QuantizeResult.of(report)
    assert report.passed and result.verdict_text == "passed" and result.step == 9
    summary = result.summary()
    assert "W8A8 (gptq) of step 9" in summary and "perplexity 2.000 -> 2.020" in summary
    assert "greedy agreement 100.0%" in summary and "P99 10.0 -> 12.0 ms" in summary
    assert QuantizeResult.model_validate_json(result.model_dump_json()) == result
    assert result.artifact_problem(None) == "runs/t/export/step-9-w8a8-gptq: no QUANTIZE.json"


def test_the_gate_data_come_from_the_held_out_split_in_the_lengths_the_section_asks(make_spec) -> None:  # noqa: ANN001
    from tasks.quantize.gate import gate_data
    from training.dataset import TokenDataset

    quantize = {"calibration_samples": 3, "eval_samples": 2, "eval_tokens": 40, "greedy_prompts": 2}
    spec = make_spec(deep_merge(SERVABLE, {"serve": {}, "quantize": quantize}))
    train = spec.training_config()
    assert spec.quantize is not None
    data = gate_data(train, spec.quantize, prompt_tokens=16)
    assert data.split == train.data.val_split
    assert [len(s) for s in data.calibration] == [128] * 3  # calibration_tokens None: model.seq_len
    assert [len(s) for s in data.evaluation] == [40, 40] and [len(s) for s in data.prompts] == [16, 16]
    held_out = TokenDataset(train.data.dataset_url, data.split, 39, train.storage)
    assert data.evaluation[0] in [held_out.sample(i).tolist() for i in range(len(held_out))]
    assert not {tuple(s[:16]) for s in data.calibration} & {tuple(s) for s in data.prompts}
    rtn = gate_data(train, spec.quantize.model_copy(update={"method": "rtn"}), prompt_tokens=16)
    assert rtn.calibration == []  # round to nearest takes no calibration data
