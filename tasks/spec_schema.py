"""The deployment spec's JSON Schema, for editors (yaml-language-server) and for checking specs as written.

pydantic gives the schema of the validated model; a spec as written may leave out what the spec fills in before
validating, so what it fills in is relaxed here, each from its owner rather than a list kept by hand:
- the paths `tasks.paths.derived_paths` derives from the deployment's folder (run.output_url, checkpoint.url, ...)
  are optional;
- with model.init_from, the architecture fields are optional (`tasks.init_from.fill_model` reads config.json);
- with model.kind vit, the text fields the model fills in from model.vision are optional (training/config.py
  ModelConfig: found by validating a vit that gives none of them);
- `additionalProperties: false` everywhere, as the models' `extra="forbid"` (a typo is an error).
The schema is stricter nowhere than the spec: every example validates against both (tests/unit/test_spec_schema.py).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from tasks.paths import derived_paths
from tasks.spec import DeploymentSpec
from training.config import ModelConfig

SCHEMA_FILE = "spec.schema.json"
"""Its name beside the examples (examples/spec.schema.json), which name it in their yaml-language-server comment."""
SCHEMA_ID = "https://transformer-deploy.dev/schema/deployment-spec.json"
EDITOR_COMMENT = f"# yaml-language-server: $schema={SCHEMA_FILE}"


def _derived_fields() -> dict[str, set[str]]:
    """{section: the fields derived_paths fills in} on a spec that gives none of them (data.prepare as `data.prepare`)."""
    given: dict[str, Any] = {"name": "x", "run": {}, "checkpoint": {}, "data": {"prepare": {}}}
    filled = derived_paths(given)
    found: dict[str, set[str]] = {}
    for section, value in filled.items():
        if isinstance(value, dict):
            added = {key for key, item in value.items() if not isinstance(item, dict)} - set(given.get(section, {}))
            if added:
                found[section] = added
    prepare = filled.get("data", {}).get("prepare", {})
    if prepare:
        found["data.prepare"] = set(prepare)
    return found


def _ref_name(schema: dict[str, Any]) -> str | None:
    """The $defs name a property's schema refers to (directly, or as the non-null branch of an Optional)."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[-1]
    for branch in schema.get("anyOf", []):
        if "$ref" in branch:
            return str(branch["$ref"]).rsplit("/", 1)[-1]
    return None


def _model_def(schema: dict[str, Any], definition: dict[str, Any]) -> dict[str, Any]:
    """The object schema of a $defs entry (a plain-URL model's is the second branch of its anyOf)."""
    if definition.get("type") == "object":
        return definition
    for branch in definition.get("anyOf", []):
        name = _ref_name(branch) if "$ref" in branch else None
        if branch.get("type") == "object":
            return branch
        if name is not None:
            return _model_def(schema, schema["$defs"][name])
    return definition


def _relax(schema: dict[str, Any], path: str, optional: set[str]) -> None:
    """Drop `optional` from the required fields of the model at dotted `path` under the root."""
    node = schema
    for part in path.split("."):
        name = _ref_name(node["properties"][part])
        assert name is not None, f"{path}: {part} is not a model in the schema"
        node = _model_def(schema, schema["$defs"][name])
    required = [field for field in node.get("required", []) if field not in optional]
    if required:
        node["required"] = required
    else:
        node.pop("required", None)


_TINY_VISION = {"image_size": 8, "patch_size": 4, "n_layers": 1, "d_model": 8, "n_heads": 1, "ffn_hidden": 8,
                "num_classes": 2}  # fmt: skip


def _filled_for_vit(required: list[str]) -> set[str]:
    """The required model fields a vit may leave out: those a vit that gives only its encoder is not refused for
    missing (the model fills them in from model.vision)."""
    given = {"kind": "vit", "vision": _TINY_VISION}
    try:
        ModelConfig.model_validate(given)
        missing: set[str] = set()
    except ValidationError as err:
        if any(e["type"] != "missing" for e in err.errors()):  # the probe itself is wrong: say so, guess nothing
            raise
        missing = {str(e["loc"][0]) for e in err.errors() if e["loc"]}
    return set(required) - missing - set(given)


def _architecture_from_init(schema: dict[str, Any]) -> None:
    """model.init_from fills the architecture: its required fields only without init_from; a vit's text fields
    (filled in from model.vision) only for the other kinds."""
    name = _ref_name(schema["properties"]["model"])
    assert name is not None
    model = schema["$defs"][name]
    required = model.pop("required", [])
    if not required:
        return
    vit = _filled_for_vit(required)
    always = [field for field in required if field not in vit]
    then: dict[str, Any] = {"required": always} if always else {}
    if vit:
        then["if"] = {"properties": {"kind": {"const": "vit"}}, "required": ["kind"]}
        then["else"] = {"required": [field for field in required if field in vit]}
    model["if"] = {"properties": {"init_from": {"type": "null"}}}
    model["then"] = then


def spec_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a deployment spec as written."""
    schema = DeploymentSpec.model_json_schema(mode="validation")
    for path, optional in _derived_fields().items():
        _relax(schema, path, optional)
    _architecture_from_init(schema)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}


def schema_text() -> str:
    """The schema as the file examples/spec.schema.json holds it (sorted keys, two-space indent, final newline)."""
    return json.dumps(spec_schema(), indent=2, sort_keys=True) + "\n"
