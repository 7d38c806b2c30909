"""The deployment spec: bad input is refused up front with messages that name field, value and fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest
import yaml
from pydantic import BaseModel, ValidationError
from typer.testing import CliRunner

from flows.cli import app
from tasks.errors import TransientError
from tasks.spec import DeploymentSpec, SpecError, load_spec, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from training.config import TrainConfig, divisors, format_validation_error
from training.secrets import is_credential_name

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
    ({"precision": {"dtype": "int4"}}, "precision.dtype=int4: must be one of 'fp32', 'bf16', 'fp16' or 'fp8'"),
    ({"precision": {"dtype": "fp8"}}, "precision.dtype=fp8: float8 training needs a GPU"),
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
    (
        {"cluster": {"scheduler": "pbs"}},
        "cluster.scheduler=pbs: must be one of 'local', 'ssh', 'slurm' or 'kubernetes'",
    ),
    ({"cluster": {"procs_per_node": 0}}, "cluster.procs_per_node=0: must be >= 1"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last=0: must be >= 1"),
    ({"checkpoint": {"save_every": 10}}, "checkpoint.save_every=10: is not a known field; remove it"),
    ({"run": {"steps": None}}, "run.steps: is required; add it to the spec"),
    ({"name": "My Run"}, "name=My Run: must be 1 to 63 lowercase letters, digits and '-', starting with a letter"),
    ({"data": {"bootstrap": {}}}, "data.bootstrap={...}: was removed; data.prepare replaced it"),
    (
        {"storage": {"options": {"secret": "x"}}},
        "storage.options.secret=<redacted>: looks like a credential; secrets never sit in specs: "
        "set AWS_SECRET_ACCESS_KEY in the job's environment or a Prefect Secret block",
    ),
    ({"model": {"n_layers": 10**30}}, f"model.n_layers={10**30}: must be <= 1024"),
    ({"parallel": {"micro_batch": 10**30}}, f"parallel.micro_batch={10**30}: must be <= 65536"),
    ({"parallel": {"grad_accum_steps": 10**30}}, f"parallel.grad_accum_steps={10**30}: must be <= 65536"),
    ({"run": {"threads_per_rank": 10**30}}, f"run.threads_per_rank={10**30}: must be <= 1024"),
    ({"run": {"seed": 2**64}}, f"run.seed={2**64}: must be <= 4294967295"),
    ({"optim": {"lr_peak": float("inf")}}, "optim.lr_peak=Infinity: must be a finite number (not Inf or NaN)"),
    ({"optim": {"lr_peak": float("nan")}}, "optim.lr_peak=NaN: must be a finite number (not Inf or NaN)"),
    ({"capacity": {"mfu": float("nan")}}, "capacity.mfu=NaN: must be a finite number"),
    ({"checkpoint": {"url": "ftp://host/c"}}, "checkpoint.url=ftp://host/c: has the unknown scheme 'ftp'"),
    ({"data": {"dataset_url": "/tmp/d\x00x"}}, "data.dataset_url=/tmp/d\\x00x: contains a control character"),
    ({"run": {"output_url": "/tmp/o\nx"}}, "run.output_url=/tmp/o\\nx: contains a control character"),
    ({"capacity": {"calibration_url": "gopher://c"}}, "capacity.calibration_url=gopher://c: has the unknown scheme"),
    ({"capacity": {"output_url": "x\x00"}}, "capacity.output_url=x\\x00: contains a control character"),
    ({"acceptance": {"work_url": "s3://b/acc"}}, "acceptance.work_url=s3://b/acc: must be a local folder"),
    (
        {"run": {"output_url": "s3://bucket/out"}},
        "run.output_url=s3://bucket/out: cluster.scheduler=local writes the run's logs and metrics to a folder on "
        "this machine; use a path such as runs/tiny/output",
    ),
    (
        {"storage": {"s3_endpoint_url": "ftp://127.0.0.1:9000"}},
        "storage.s3_endpoint_url=ftp://127.0.0.1:9000: must be an http:// or https:// URL",
    ),
    (
        {"storage": {"s3_endpoint_url": "http://minio:hunter2@127.0.0.1:9000"}},
        "storage.s3_endpoint_url=http://minio:<redacted>@127.0.0.1:9000: holds a password (user:password@)",
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


def test_a_secret_nested_anywhere_is_refused_by_its_full_path_without_echoing_it() -> None:
    nested = {
        "storage": {"options": {"client_kwargs": {"aws_secret_access_key": "hunter2-nested"}}},
        "cluster": {"env": {"AWS_SECRET_ACCESS_KEY": "hunter2-env", "NCCL_DEBUG": "WARN"}},
        "nodes": {"hosts": [{"name": "n1", "password": "hunter2-host"}]},
    }
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(BASE, nested))
    problems = caught.value.problems
    assert (
        "storage.options.client_kwargs.aws_secret_access_key=<redacted>: looks like a credential; secrets never sit "
        "in specs: set AWS_SECRET_ACCESS_KEY in the job's environment or a Prefect Secret block"
    ) in problems
    assert any(p.startswith("cluster.env.AWS_SECRET_ACCESS_KEY=<redacted>: looks like a credential") for p in problems)
    assert any(p.startswith("nodes.hosts.0.password=<redacted>: looks like a credential") for p in problems)
    assert "hunter2" not in str(caught.value)


def test_the_cluster_side_of_the_boundary_refuses_a_nested_secret_too(tmp_path: Path) -> None:
    cfg = parse_spec(BASE).training_config().model_dump()
    cfg["storage"]["options"] = {"client_kwargs": {"aws_session_token": "hunter2"}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValidationError) as caught:
        TrainConfig.from_json_file(path)
    lines = format_validation_error(caught.value)
    assert lines == [
        "storage.options.client_kwargs.aws_session_token=<redacted>: looks like a credential; secrets never sit in "
        "specs: set AWS_SESSION_TOKEN in the job's environment or a Prefect Secret block"
    ]
    assert "hunter2" not in str(caught.value)


def _schema_field_names(model: type[BaseModel], seen: set[type] | None = None) -> set[str]:
    seen = seen if seen is not None else set()
    names: set[str] = set()
    for name, info in model.model_fields.items():
        names.add(name)
        for kind in [info.annotation, *get_args(info.annotation)]:
            for inner in [kind, *get_args(kind)]:
                if isinstance(inner, type) and issubclass(inner, BaseModel) and inner not in seen:
                    seen.add(inner)
                    names |= _schema_field_names(inner, seen)
    return names


def test_no_field_of_the_spec_schema_or_the_examples_looks_like_a_credential() -> None:
    names = _schema_field_names(DeploymentSpec)
    assert {"tokenizer", "tokenizer_sha256", "eos_token", "ssh_key_path", "train_tokens"} <= names
    assert sorted(n for n in names if is_credential_name(n)) == []
    for example in sorted((REPO / "examples").glob("*.yaml")):
        load_spec(example)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"name: caf\xe9\n", "is not UTF-8 text: byte 0xe9 at offset 9 cannot be decoded; save the file as UTF-8"),
        (
            b"a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n",
            "not valid YAML at line 2, column 8: found the alias *a: aliases are not allowed in a deployment spec",
        ),
        (b"name: a\nname: b\n", "not valid YAML at line 2, column 1: the key 'name' appears twice in one mapping"),
        (b"name: " + b"[" * 200 + b"]" * 200 + b"\n", "nesting deeper than 32 levels"),
        (b"name: x\n" + b"#" * (1 << 20), "is larger than 1048576 bytes; a spec is a few kB: check the path"),
        (b"", "<spec>: the spec is empty"),
        (b"- name: x\n", "<spec>=list: the spec must be a YAML mapping of sections"),
    ],
    ids=["not-utf8", "alias-bomb", "duplicate-key", "deep-nesting", "too-large", "empty", "list"],
)
def test_a_spec_file_that_is_no_yaml_mapping_is_refused_with_one_clear_line(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_bytes(content)
    with pytest.raises(SpecError) as caught:
        load_spec(path)
    assert len(caught.value.problems) == 1 and expected in caught.value.problems[0], caught.value.problems
    assert "\n" not in caught.value.problems[0]


def test_a_connection_error_while_reading_the_spec_is_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*args: object, **kwargs: object) -> None:
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr("tasks.spec.fsspec.open", refused)
    with pytest.raises(TransientError, match="reading the spec s3://bucket/spec.yaml failed"):
        load_spec("s3://bucket/spec.yaml")


def test_divisors_are_every_divisor_in_ascending_order() -> None:
    for n in range(1, 400):
        assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n
    assert divisors(2**40) == [2**k for k in range(41)]


@pytest.mark.parametrize(
    "secret",
    [
        {"storage": {"options": {"client_kwargs": {"aws_secret_access_key": "hunter2"}}}},
        {"cluster": {"env": {"AWS_SECRET_ACCESS_KEY": "hunter2"}}},
    ],
    ids=["storage-options", "cluster-env"],
)
def test_a_nested_secret_never_reaches_run_json_or_the_kubernetes_manifests(tmp_path: Path, secret: dict) -> None:
    from tasks.launch.kubernetes import render_manifests

    data = deep_merge(deep_merge(BASE, {"cluster": {"scheduler": "kubernetes"}}), secret)
    try:
        spec = parse_spec(data)
    except SpecError as err:
        assert "hunter2" not in str(err)
        return
    train = spec.training_config()  # only reached if the boundary let the secret through
    train.to_json_file(tmp_path / "run.json")
    written = (tmp_path / "run.json").read_text() + json.dumps(render_manifests(spec.cluster, train, "tiny", "img"))
    assert "hunter2" not in written, "the secret reached run.json or the manifests"


def _example(**changes: object) -> dict:
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    return {**data, **changes}


def _paths(spec: DeploymentSpec) -> dict[str, str | None]:
    assert spec.data.prepare is not None
    return {
        "output": spec.run.output_url,
        "checkpoints": spec.checkpoint.url,
        "datasets": spec.data.prepare.output_url,
        "plan": spec.capacity.output_url,
        "acceptance": spec.acceptance.work_url,
        "reports": spec.reports_dir,
    }


def test_the_example_derives_every_path_from_its_name_so_a_renamed_copy_writes_elsewhere() -> None:
    local, other = parse_spec(_example()), parse_spec(_example(name="other"))
    assert _paths(local) == {
        "output": "runs/local/output",
        "checkpoints": "runs/local/checkpoints",
        "datasets": "runs/local/datasets",
        "plan": "runs/local",
        "acceptance": "runs/local/acceptance",
        "reports": "runs/local",
    }
    assert _paths(other) == {k: v.replace("runs/local", "runs/other") for k, v in _paths(local).items()}


def test_deployment_dir_moves_every_derived_path_and_explicit_paths_are_kept(tmp_path: Path) -> None:
    data = _example(deployment_dir=str(tmp_path / "dep"))
    data["checkpoint"] = {**data["checkpoint"], "url": "s3://bucket/ckpt"}
    data["acceptance"] = {**data["acceptance"], "work_url": str(tmp_path / "acc")}
    paths = _paths(parse_spec(data))
    assert paths == {
        "output": str(tmp_path / "dep" / "output"),
        "checkpoints": "s3://bucket/ckpt",
        "datasets": str(tmp_path / "dep" / "datasets"),
        "plan": str(tmp_path / "dep"),
        "acceptance": str(tmp_path / "acc"),
        "reports": str(tmp_path / "dep"),
    }


def test_a_spec_with_derived_paths_round_trips_unchanged() -> None:
    spec = parse_spec(_example(name="other"))
    assert parse_spec(spec.model_dump()) == spec


def test_a_bad_name_is_the_only_problem_reported_when_paths_derive_from_it() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_example(name="My Run"))
    assert [p.split(":")[0] for p in caught.value.problems] == ["name=My Run"]


def test_an_object_store_deployment_dir_is_refused_with_the_field_named() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(_example(deployment_dir="s3://bucket/dep"))
    assert any(p.startswith("deployment_dir=s3://bucket/dep: must be a local folder") for p in caught.value.problems)
