"""The deployment spec: bad input is refused up front with messages that name field, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.spec import SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from training.config import TrainConfig

BASE = deep_merge(
    TINY_SPEC,
    {"data": {"dataset_url": "/tmp/d"}, "checkpoint": {"url": "/tmp/c"}, "run": {"output_url": "/tmp/o"}},
)

BAD_SPECS = [
    ({"parallel": {"micro_batch": 0}}, "parallel.micro_batch=0: must be >= 1"),
    ({"parallel": {"sharding": "zero9"}}, "parallel.sharding=zero9: must be one of 'ddp', 'fsdp' or 'hsdp'"),
    ({"model": {"n_heads": 5}}, "model.n_heads=5: must divide d_model=32; use one of"),
    ({"model": {"n_kv_heads": 3}}, "model.n_kv_heads=3: must divide n_heads=4; use one of [1, 2, 4]"),
    ({"model": {"moe": {"n_experts": 2, "top_k": 3}}}, "model.moe.top_k=3: must be <= n_experts=2"),
    ({"optim": {"lr_peak": -1}}, "optim.lr_peak=-1: must be > 0"),
    ({"optim": {"lr_min": 1.0}}, "optim.lr_min=1.0: must be <= lr_peak=0.003"),
    ({"optim": {"schedule": "step"}}, "optim.schedule=step: must be one of 'cosine', 'linear' or 'constant'"),
    ({"optim": {"warmup_steps": 50}}, "optim.warmup_steps=50: must be <= run.steps=20"),
    ({"precision": {"dtype": "fp8"}}, "precision.dtype=fp8: must be one of 'fp32', 'bf16' or 'fp16'"),
    (
        {"precision": {"dtype": "fp16"}, "parallel": {"sharding": "fsdp"}},
        "precision.dtype=fp16: fp16 loss scaling is supported with parallel.sharding=ddp only",
    ),
    (
        {"parallel": {"data_parallel": 3}},
        "parallel.data_parallel=3: must equal cluster.nodes x cluster.procs_per_node = 2; set it to 2",
    ),
    (
        {"parallel": {"sharding": "hsdp", "hsdp_shard_size": 3}},
        "parallel.hsdp_shard_size=3: must divide the world size 2; use one of [1, 2]",
    ),
    (
        {"parallel": {"ddp_grad_compression": "bf16", "sharding": "fsdp"}},
        "parallel.ddp_grad_compression=bf16: only applies to sharding=ddp (got fsdp); remove it",
    ),
    ({"cluster": {"scheduler": "pbs"}}, "cluster.scheduler=pbs: must be one of 'local', 'slurm' or 'kubernetes'"),
    ({"cluster": {"procs_per_node": 0}}, "cluster.procs_per_node=0: must be >= 1"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last=0: must be >= 1"),
    ({"checkpoint": {"save_every": 10}}, "checkpoint.save_every=10: is not a known field; remove it"),
    ({"run": {"steps": None}}, "run.steps: is required; add it to the spec"),
    ({"name": "My Run"}, "name=My Run: must match the pattern ^[a-z0-9][a-z0-9-]{0,62}$"),
    (
        {"storage": {"options": {"secret": "x"}}},
        "storage.options={...}: option 'secret' looks like a credential; secrets never sit in specs",
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), BAD_SPECS, ids=[e.split(":")[0] for _, e in BAD_SPECS])
def test_bad_spec_is_refused_with_field_value_and_fix(overrides: dict, expected: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, overrides))
    assert any(p.startswith(expected) for p in caught.value.problems), caught.value.problems


def test_every_field_error_is_reported_at_once() -> None:
    bad = deep_merge(BASE, {"parallel": {"micro_batch": 0}, "optim": {"lr_peak": 0}, "cluster": {"nodes": 0}})
    with pytest.raises(SpecError) as caught:
        parse_spec(bad)
    fields = sorted(p.split("=")[0] for p in caught.value.problems)
    assert fields == ["cluster.nodes", "optim.lr_peak", "parallel.micro_batch"]


def test_training_config_round_trips_through_json(tmp_path: Path) -> None:
    cfg = parse_spec(deep_merge(BASE, {"model": {"moe": {"n_experts": 4}}})).training_config()
    cfg.to_json_file(tmp_path / "run.json")
    assert TrainConfig.from_json_file(tmp_path / "run.json") == cfg


def test_embedded_default_spec_is_valid() -> None:
    spec = load_spec(REPO / "examples" / "local.yaml")
    assert spec.cluster.scheduler == "local" and spec.cluster.world_size == 2
    assert spec.data.prepare is not None and spec.data.prepare.builtin_corpus == "python-docs"


def test_validate_spec_cli_prints_ok_or_every_problem(tmp_path: Path) -> None:
    runner = CliRunner()
    good = runner.invoke(app, ["validate-spec", str(REPO / "examples" / "local.yaml")])
    assert good.exit_code == 0 and good.output.startswith("ok")

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(deep_merge(BASE, {"parallel": {"micro_batch": 0}, "model": {"n_kv_heads": 3}})))
    bad = runner.invoke(app, ["validate-spec", str(path)])
    assert bad.exit_code == 2
    assert "parallel.micro_batch=0: must be >= 1" in bad.output
    assert "model.n_kv_heads=3: must divide n_heads=4" in bad.output


def test_missing_spec_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
