"""The ONNX export's inputs and verdicts without exporting: folder names, refused formats and destinations, and
how an int8 variant is judged by both of its bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.export.onnx import Int8Bounds, OnnxParity, check_format, io_names, onnx_dirs


def test_onnx_folders_sit_beside_the_hf_folder_unless_out_names_the_fp32_one(tmp_path: Path) -> None:
    hf = tmp_path / "export" / "step-4"
    assert onnx_dirs(str(hf)) == (hf.with_name("step-4-onnx"), hf.with_name("step-4-onnx-int8"))
    assert onnx_dirs(str(hf), str(tmp_path / "edge")) == (tmp_path / "edge", tmp_path / "edge-int8")
    assert onnx_dirs(str(hf), f"file://{tmp_path}/edge")[0] == tmp_path / "edge"


def test_an_onnx_export_to_an_object_store_is_refused_naming_the_url() -> None:
    with pytest.raises(UserError, match=r"out=s3://bucket/onnx: an ONNX export is written to a local folder"):
        onnx_dirs("/models/step-4", "s3://bucket/onnx")


@pytest.mark.parametrize("value", ["ONNX", "tflite", ""])
def test_a_format_other_than_hf_or_onnx_is_refused_naming_both(value: str) -> None:
    with pytest.raises(UserError, match=f"--format={value}: not an export format; use one of hf, onnx"):
        check_format(value)
    assert check_format("onnx") == "onnx" and check_format("hf") == "hf"


def test_the_graph_io_names_follow_optimums_cache_layout() -> None:
    inputs, outputs = io_names(2)
    assert inputs == ["input_ids", "attention_mask", "position_ids", "past_key_values.0.key",
                      "past_key_values.0.value", "past_key_values.1.key", "past_key_values.1.value"]  # fmt: skip
    assert outputs == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]


def _int8(top1: float, diff: float) -> OnnxParity:
    return OnnxParity(precision="int8", reference="r", prompts=4, prompt_tokens=16, prompts_from="p",
                      max_abs_logit_diff=diff, max_abs_logit=2.0, top1_agreement=top1, bounds=Int8Bounds())  # fmt: skip


def test_int8_is_judged_by_top1_agreement_and_by_the_relative_logit_error() -> None:
    assert _int8(0.95, 0.1).passed  # relative error 0.05
    assert _int8(0.85, 0.1).problems() == ["top-1 agreement 0.850 < 0.9"]
    # every logit doubled keeps each top-1 token; only the error bound sees it
    assert _int8(1.0, 2.0).problems() == ["max |logit error| / max |logit| 1 > 0.1"]


def test_fp32_is_judged_whole_and_through_the_cache() -> None:
    common = dict(precision="fp32", reference="r", prompts=4, prompt_tokens=16, prompts_from="p",
                  max_abs_logit=2.0, top1_agreement=1.0, tolerance=1e-3)  # fmt: skip
    assert OnnxParity(**common, max_abs_logit_diff=1e-7, decode_max_abs_logit_diff=2e-7).passed
    cached = OnnxParity(**common, max_abs_logit_diff=1e-7, decode_max_abs_logit_diff=0.5)
    assert cached.problems() == ["through the KV cache: max |logit diff| 0.5 > tolerance 0.001"]
    nan = OnnxParity(**common, max_abs_logit_diff=float("nan"), decode_max_abs_logit_diff=1e-7)
    assert not nan.passed  # a NaN logit is no pass
