"""precision.dtype fp8 and run.compile's default, checked on the CPU: the refusals (spec and run time) name the
field, the value and the fix; the float8 conversion swaps the blocks' Linear layers only; the acceptance gate
judges recorded fp8 and bf16 loss curves; compile resolves to on for GPU data-parallel jobs only."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from tasks.acceptance.compiled import with_compile_note
from tasks.acceptance.fp8_parity import MAX_ABS_LOSS_GAP, MAX_REL_LOSS_GAP, bf16_twin, judge_fp8_parity, with_fp8_parity
from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training import float8
from training.config import ModelConfig, MoEConfig, ParallelConfig, PrecisionConfig, RunConfig, resolve_compile
from training.model import Transformer, blocks_of
from validation.acceptance import DimensionResult

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)
GPU = {"cluster": {"accelerator": "h100-sxm", "scheduler": "slurm"}}


@pytest.fixture
def inductor_config():
    """convert_blocks sets inductor's emulate_precision_casts (torchtitan's rowwise workaround): restored after."""
    import torch._inductor.config as config

    with config.patch(emulate_precision_casts=config.emulate_precision_casts):
        yield config


def _problems(raw: dict) -> list[str]:
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    return err.value.problems


def test_fp8_on_a_cpu_cluster_is_refused_naming_the_field_the_value_and_the_fix() -> None:
    problems = _problems(deep_merge(BASE, {"precision": {"dtype": "fp8"}}))
    fp8 = [p for p in problems if p.startswith("precision.dtype=fp8:")]
    assert len(fp8) == 1, problems
    assert "cluster.accelerator=cpu" in fp8[0] and "set precision.dtype: bf16 on CPU" in fp8[0]
    assert "sm_89" in fp8[0]


def test_fp8_on_a_gpu_cluster_is_accepted_and_exported_in_bf16() -> None:
    spec = parse_spec(deep_merge(BASE, {**GPU, "precision": {"dtype": "fp8"}}))
    assert spec.precision.dtype == "fp8" and spec.precision.torch_name == "bfloat16"


def test_fp8_with_tensor_parallelism_is_refused_with_the_fix() -> None:
    raw = deep_merge(BASE, {**GPU, "precision": {"dtype": "fp8"}, "parallel": {"tensor_parallel": 2}})
    fp8 = [p for p in _problems(raw) if p.startswith("precision.dtype=fp8:")]
    assert len(fp8) == 1 and "parallel.tensor_parallel=2" in fp8[0] and "precision.dtype: bf16" in fp8[0]


def test_the_run_time_check_refuses_cpu_and_gpus_below_compute_capability_8_9(monkeypatch) -> None:
    with pytest.raises(float8.Float8Unavailable, match=r"precision.dtype=fp8: the job runs on cpu.*sm_89"):
        float8.require_float8_device(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(float8.Float8Unavailable, match=r"A100-SXM4-80GB has compute capability 8\.0 \(< 8\.9\)"):
        float8.require_float8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    float8.require_float8_device(torch.device("cuda", 0))  # an H100: no error


@pytest.mark.parametrize(
    ("fqn", "shape", "converted"),
    [
        ("attn.wq", (64, 64), True),
        ("mlp.w2", (64, 176), True),
        ("mlp.w1", (172, 64), False),  # 172 is not a multiple of 16
        ("moe.router", (64, 64), False),
        ("moe.experts.3.w1", (128, 64), False),
    ],
)
def test_the_filter_converts_block_linears_with_dims_multiple_of_16_outside_moe(fqn, shape, converted) -> None:
    assert float8.converts(nn.Linear(shape[1], shape[0], bias=False), fqn) is converted
    assert float8.converts(nn.LayerNorm(64), fqn) is False


def test_the_conversion_swaps_the_blocks_linears_and_keeps_head_embeddings_and_checkpoint_keys(inductor_config) -> None:
    cfg = ModelConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=176, vocab_size=256, seq_len=16)
    model = Transformer(cfg)
    keys = list(model.state_dict())
    assert float8.convert_blocks(blocks_of(model)) == 14  # 2 blocks x (wq, wk, wv, wo, w1, w3, w2)
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("lm_head") == "Linear" and set(kinds.values()) == {"Float8Linear"}
    assert not any("Float8" in type(m).__name__ for m in model.modules() if isinstance(m, nn.Embedding))
    assert list(model.state_dict()) == keys  # checkpoints and exports read the same names as a bf16 run's
    assert inductor_config.emulate_precision_casts is True  # compiled rowwise casts round as eager ones


def test_an_moe_blocks_router_and_experts_stay_in_bf16(inductor_config) -> None:
    moe = MoEConfig(n_experts=2, top_k=1)
    cfg = ModelConfig(n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=256, seq_len=16,
                      moe=moe)  # fmt: skip
    model = Transformer(cfg)
    float8.convert_blocks(blocks_of(model))
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {f"blocks.0.attn.{w}" for w in ("wq", "wk", "wv", "wo")}


@pytest.mark.parametrize(
    ("compile_", "parallel", "device", "expected"),
    [
        (None, {}, "cuda", True),
        (None, {}, "cpu", False),
        (None, {"pipeline_parallel": 2}, "cuda", False),
        (False, {}, "cuda", False),
        (True, {}, "cpu", True),
    ],
    ids=["gpu ddp", "cpu", "gpu pipeline", "explicit off", "explicit on"],
)
def test_run_compile_defaults_to_on_for_gpu_data_parallel_jobs_only(compile_, parallel, device, expected) -> None:
    run = RunConfig(steps=1, output_url="/tmp/o", compile=compile_)
    assert RunConfig(steps=1, output_url="/tmp/o").compile is None
    assert resolve_compile(run, ParallelConfig(micro_batch=1, **parallel), device) is expected


def _curve(start: float, rate: float, steps: int = 40, scale: float = 1.0) -> dict[int, float]:
    return {s: scale * (start * math.exp(-rate * s) + 2.0) for s in range(1, steps + 1)}


def test_the_parity_gate_passes_curves_within_the_tolerance_and_fails_a_gap_beyond_it() -> None:
    bf16 = _curve(4.0, 0.1)
    close = judge_fp8_parity(_curve(4.0, 0.1, scale=1.005), bf16)  # 0.5% above: within torchao's reported parity
    assert close.passed is True and close.measured["rel_loss_gap"] == pytest.approx(0.005, abs=1e-6)
    assert close.measured["window_steps"] == [31, 40]  # the last quarter of the 40 common steps
    far = judge_fp8_parity(_curve(4.0, 0.1, scale=1.05), bf16)
    assert far.passed is False and "5.00% apart (> 2%" in far.message and "precision.dtype: bf16" in far.message
    assert far.threshold == {"max_rel_loss_gap": MAX_REL_LOSS_GAP, "max_abs_loss_gap": MAX_ABS_LOSS_GAP}
    # near zero loss (a memorised dataset) a large ratio of tiny losses passes within MAX_ABS_LOSS_GAP nats
    tiny = {s: 0.02 for s in range(1, 21)}
    assert judge_fp8_parity({s: 0.026 for s in tiny}, tiny).passed is True


def test_the_parity_gate_fails_a_diverged_fp8_run_and_measures_nothing_without_common_steps() -> None:
    bf16 = _curve(4.0, 0.1)
    diverged = {**_curve(4.0, 0.1), 12: float("nan")}
    verdict = judge_fp8_parity(diverged, bf16)
    assert verdict.passed is False and verdict.measured["first_nonfinite_step"] == 12
    assert judge_fp8_parity(_curve(4.0, 0.1, steps=3), bf16).passed is None


def test_the_gate_fails_the_correctness_dimension_and_keeps_its_figures() -> None:
    correctness = DimensionResult(name="correctness", passed=True, measured={"agreement": 0.01}, threshold={})
    failed = with_fp8_parity(correctness, judge_fp8_parity(_curve(4.0, 0.1, scale=1.1), _curve(4.0, 0.1)))
    assert failed.passed is False and failed.measured["agreement"] == 0.01 and "fp8_parity" in failed.measured
    passed = with_fp8_parity(correctness, judge_fp8_parity(_curve(4.0, 0.1), _curve(4.0, 0.1)))
    assert passed.passed is True


def test_the_bf16_twin_is_the_same_spec_in_bf16_stopped_early(tmp_path: Path) -> None:
    spec = parse_spec(deep_merge(BASE, {**GPU, "precision": {"dtype": "fp8"}}))
    twin = bf16_twin(spec.training_config(), tmp_path, 5)
    assert twin.precision.dtype == "bf16" and twin.run.stop_after_steps == 5 and twin.run.steps == spec.run.steps
    assert twin.run.seed == spec.run.seed and twin.run.output_url.startswith(str(tmp_path / "fp8-parity-bf16"))


def test_the_compile_note_marks_correctness_as_compiled_vs_eager() -> None:
    correctness = DimensionResult(name="correctness", passed=True, message="agrees")
    noted = with_compile_note(correctness, compiled=True)
    assert noted.evidence["compiled_vs_eager"] is True and "vs the eager reference" in noted.message
    assert with_compile_note(correctness, compiled=False) == correctness


def test_precision_fp8_exports_in_bf16() -> None:
    assert PrecisionConfig(dtype="fp8").torch_name == "bfloat16"
