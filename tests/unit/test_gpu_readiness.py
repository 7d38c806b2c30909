"""What makes the training loop ready for GPUs, checked on the CPU: the fused optimizer where it runs, bf16 as a
GPU deployment's default precision, and the refusals that name the field and the fix."""

from __future__ import annotations

import pytest
import torch

from tasks.spec import SpecError, parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from training.config import OptimConfig
from training.train import build_optimizer

BASE = deep_merge(
    TINY_SPEC, {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}}
)


def _without_dtype(raw: dict) -> dict:
    raw = deep_merge(raw, {})
    raw.get("precision", {}).pop("dtype", None)
    return raw


def test_auto_takes_the_fused_adamw_on_gpus_and_pytorchs_default_on_cpu() -> None:
    model = torch.nn.Linear(4, 4)
    assert build_optimizer(model, OptimConfig(lr_peak=1e-3), "cuda").defaults["fused"] is True
    assert not build_optimizer(model, OptimConfig(lr_peak=1e-3), "cpu").defaults["fused"]
    foreach = build_optimizer(model, OptimConfig(lr_peak=1e-3, implementation="foreach"), "cpu")
    assert foreach.defaults["foreach"] is True
    with pytest.raises(ValueError, match="optim.implementation=fused needs GPUs"):
        build_optimizer(model, OptimConfig(lr_peak=1e-3, implementation="fused"), "cpu")


@pytest.mark.parametrize(
    ("cluster", "capacity", "dtype"),
    [
        ({"accelerator": "h100-sxm", "scheduler": "slurm"}, {}, "bf16"),
        ({"accelerator": "cpu"}, {}, "fp32"),
        ({"accelerator": "my-gpu", "scheduler": "slurm"}, {"accelerators": {"my-gpu": {
            "kind": "gpu", "memory_gib": 40, "peak_tflops_bf16": 100, "peak_tflops_fp16": 100,
            "peak_tflops_fp32": 20, "hbm_tb_s": 1, "intra_node_gb_s": 100, "inter_node_gb_s": 10}}}, "bf16"),
    ],
    ids=["catalogue gpu", "cpu", "gpu the spec describes"],
)  # fmt: skip
def test_a_spec_without_a_dtype_trains_in_bf16_on_gpus_and_fp32_on_cpus(
    cluster: dict, capacity: dict, dtype: str
) -> None:
    raw = _without_dtype(deep_merge(BASE, {"cluster": cluster, "capacity": capacity}))
    assert parse_spec(raw).precision.dtype == dtype


def test_a_dtype_the_spec_gives_is_kept_on_gpus() -> None:
    raw = deep_merge(
        BASE, {"cluster": {"accelerator": "h100-sxm", "scheduler": "slurm"}, "precision": {"dtype": "fp32"}}
    )
    assert parse_spec(raw).precision.dtype == "fp32"


def test_compiling_a_model_parallel_layout_is_refused_with_the_fix() -> None:
    raw = deep_merge(
        BASE, {"cluster": {"procs_per_node": 2}, "parallel": {"tensor_parallel": 2}, "run": {"compile": True}}
    )
    with pytest.raises(SpecError) as err:
        parse_spec(raw)
    assert any(
        p.startswith("run.compile=true: compiles the blocks of data-parallel layouts only") for p in err.value.problems
    )
