"""The serve section: a model vLLM cannot serve is refused with the spec, before any training, unless serve: null."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tasks.serve.config import ServeConfig, unservable
from tasks.spec import SpecError, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from training.config import ModelConfig

# TINY_SPEC's paths filled in, and one 32-wide head (d_model 32): a model vLLM's CPU attention serves.
SERVABLE = deep_merge(
    TINY_SPEC,
    {
        "model": {"n_heads": 1, "n_kv_heads": 1},
        "data": {"dataset_url": "/tmp/d"},
        "checkpoint": {"url": "/tmp/c"},
        "run": {"output_url": "/tmp/o"},
    },
)
HEAD_DIM_16 = {"model": {"d_model": 64, "n_heads": 4, "n_kv_heads": 2}}


def _model(**fields: int) -> ModelConfig:
    shape = {"n_layers": 2, "d_model": 64, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 128, "vocab_size": 256}
    return ModelConfig(**{**shape, "seq_len": 64, **fields})


def test_head_dim_16_cannot_be_served_on_cpu_and_the_fix_names_n_heads() -> None:
    problems = unservable(_model(n_heads=4, n_kv_heads=2), ServeConfig(), "cpu")
    assert len(problems) == 1
    assert problems[0].startswith("model.head_dim=16 (d_model=64 / n_heads=4)")
    assert "set model.n_heads to 2, 1 (head_dim [32, 64])" in problems[0]


def test_head_dim_32_is_served_on_cpu_and_head_dim_16_on_a_gpu() -> None:
    assert unservable(_model(), ServeConfig(), "cpu") == []
    assert unservable(_model(n_heads=4, n_kv_heads=2), ServeConfig(), "h100-sxm") == []


def test_max_model_len_beyond_the_trained_seq_len_is_refused() -> None:
    assert unservable(_model(), ServeConfig(max_model_len=64), "cpu") == []
    (problem,) = unservable(_model(), ServeConfig(max_model_len=65), "cpu")
    assert problem.startswith("serve.max_model_len=65: longer than the trained model.seq_len=64")
    assert "use at most 64" in problem


def test_tensor_parallel_must_divide_the_query_and_key_value_heads() -> None:
    model = _model(d_model=256, n_heads=4, n_kv_heads=2)
    assert unservable(model, ServeConfig(tensor_parallel=2), "h100-sxm") == []
    (problem,) = unservable(model, ServeConfig(tensor_parallel=4), "h100-sxm")
    assert problem.startswith("serve.tensor_parallel=4: must divide n_heads=4 and n_kv_heads=2")


def test_a_spec_whose_model_cannot_be_served_lists_the_problem_with_both_fixes() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(SERVABLE, {**HEAD_DIM_16, "serve": {"max_model_len": 128}}))
    problems = caught.value.problems
    head = next(p for p in problems if p.startswith("model.head_dim=16 (d_model=64 / n_heads=4): "))
    assert "set model.n_heads to 2, 1" in head and head.endswith("or set serve: null to train without serving")
    assert any(p.startswith("serve.max_model_len=128: longer than the trained model.seq_len=32") for p in problems)


def test_serving_is_off_unless_the_spec_has_a_serve_section_and_null_turns_it_off() -> None:
    assert parse_spec({**SERVABLE, "serve": {}}).serve == ServeConfig()
    assert parse_spec(deep_merge(SERVABLE, HEAD_DIM_16)).serve is None  # no section: nothing to serve, no refusal
    data = deep_merge(SERVABLE, {**HEAD_DIM_16, "serve": {}})
    data["serve"] = None  # deep_merge would delete the key
    assert parse_spec(data).serve is None


def test_an_unknown_serve_field_is_refused() -> None:
    with pytest.raises(SpecError, match=r"serve\.gpus"):
        parse_spec(deep_merge(SERVABLE, {"serve": {"gpus": 2}}))


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda path: path.stem)
def test_every_example_can_be_served_as_it_says(example: Path) -> None:
    try:
        parse_spec(yaml.safe_load(example.read_text()), str(example))
    except SpecError as err:
        serving = [p for p in err.problems if "serve: null" in p]
        assert not serving, f"{example.name}: " + "; ".join(serving)
        raise
