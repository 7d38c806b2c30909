"""The spec's JSON Schema: up to date beside the examples, named by each of them, taking every example as written
and refusing what the spec refuses by shape (a typo, a missing field, a wrong type)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.spec_schema import EDITOR_COMMENT, SCHEMA_FILE, schema_text, spec_schema
from tests.conftest import REPO

EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = spec_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(validator: jsonschema.Draft202012Validator, data: dict[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(data)]


def test_the_schema_beside_the_examples_is_the_one_the_spec_generates() -> None:
    written = (REPO / "examples" / SCHEMA_FILE).read_text()
    assert written == schema_text(), "run `tdeploy schema --out examples/spec.schema.json` after changing the spec"


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_names_the_schema_and_validates_against_it(
    example: Path, validator: jsonschema.Draft202012Validator
) -> None:
    text = example.read_text()
    assert text.splitlines()[0] == EDITOR_COMMENT
    assert _errors(validator, yaml.safe_load(text)) == []


def test_a_typo_is_refused_naming_the_key(validator: jsonschema.Draft202012Validator) -> None:
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    data["run"]["stepz"] = 3
    data["cluster"]["procs_per_nodes"] = 2
    errors = _errors(validator, data)
    assert any(e.startswith("run:") and "'stepz' was unexpected" in e for e in errors), errors
    assert any(e.startswith("cluster:") and "'procs_per_nodes' was unexpected" in e for e in errors), errors


def test_a_wrong_type_and_a_missing_architecture_are_refused(validator: jsonschema.Draft202012Validator) -> None:
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    data["run"]["steps"] = "many"
    del data["model"]["n_layers"]
    errors = _errors(validator, data)
    assert any(e.startswith("run.steps:") for e in errors), errors
    assert any("'n_layers' is a required property" in e for e in errors), errors


def test_what_the_spec_fills_in_may_be_left_out(validator: jsonschema.Draft202012Validator) -> None:
    """Derived paths, the architecture of model.init_from and a source given as its URL alone: as written."""
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    for section, key in (("run", "output_url"), ("checkpoint", "url")):
        data[section].pop(key, None)
    data["data"]["prepare"].pop("builtin_corpus", None)
    data["data"]["prepare"]["sources"] = ["corpus/*.txt", {"url": "more/*.jsonl", "format": "jsonl"}]
    data["model"] = {"init_from": "examples/models/tiny-llama"}
    assert _errors(validator, data) == []


def test_a_vit_may_leave_out_the_text_fields_its_encoder_fills_in(
    validator: jsonschema.Draft202012Validator,
) -> None:
    data = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
    vision = {"image_size": 32, "patch_size": 8, "n_layers": 2, "d_model": 64, "n_heads": 2, "ffn_hidden": 128,
              "num_classes": 4}  # fmt: skip
    data["model"] = {"kind": "vit", "vision": vision}
    assert _errors(validator, data) == []
    data["model"]["kind"] = "vlm"  # a vlm's language model is its own: its architecture is required
    assert any("'n_layers' is a required property" in e for e in _errors(validator, data))
    del data["model"]["kind"]  # lm, the default
    assert any("'seq_len' is a required property" in e for e in _errors(validator, data))


def test_tdeploy_schema_writes_the_schema(tmp_path: Path) -> None:
    out = tmp_path / "spec.schema.json"
    result = CliRunner().invoke(app, ["schema", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text() == schema_text()
