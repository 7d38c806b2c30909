"""The generated spec reference (tasks/spec_reference.py, the docs site's reference page): every field of
DeploymentSpec with its facts, and a field without a description refused."""

from __future__ import annotations

from typing import Any, Literal

import pytest
from pydantic import BaseModel, Field

from tasks.spec import DeploymentSpec
from tasks.spec_reference import UndescribedFields, field_rows, load_examples, render_markdown, unit_of
from tests.conftest import REPO


def schema_paths(schema: dict[str, Any]) -> set[str]:
    """Every field's dotted path, found by walking pydantic's JSON Schema (not the models the generator walks)."""
    defs = schema.get("$defs", {})
    paths: set[str] = set()

    def walk(node: dict[str, Any], prefix: str, seen: frozenset[str]) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[1]
            if name not in seen:
                walk(defs[name], prefix, seen | {name})
            return
        for key in ("anyOf", "oneOf", "allOf"):
            for option in node.get(key, []):
                walk(option, prefix, seen)
        if isinstance(node.get("items"), dict):
            walk(node["items"], prefix + "[]", seen)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], prefix + ".<key>", seen)
        for name, sub in node.get("properties", {}).items():
            path = f"{prefix}.{name}" if prefix else name
            paths.add(path)
            walk(sub, path, seen)

    walk(schema, "", frozenset())
    return paths


def test_the_reference_lists_every_field_of_the_deployment_spec() -> None:
    rows = field_rows(DeploymentSpec, load_examples(REPO / "examples"))
    listed = [row.path for row in rows]
    assert len(listed) == len(set(listed)), "a field is listed twice"
    expected = schema_paths(DeploymentSpec.model_json_schema())
    assert set(listed) == expected, (sorted(expected - set(listed)), sorted(set(listed) - expected))
    assert len(rows) > 300 and all(row.description for row in rows)


def test_a_field_without_a_description_is_refused_with_its_path() -> None:
    class Inner(BaseModel):
        timeout_s: float = Field(default=30.0, description="How long to wait.")
        retries: int = 3

    class Outer(BaseModel):
        """A root model."""

        inner: list[Inner] = Field(default_factory=list, description="Items.")

    with pytest.raises(UndescribedFields) as err:
        field_rows(Outer)
    assert err.value.paths == ["inner[].retries"]
    assert "inner[].retries" in str(err.value) and "description" in str(err.value)


def test_rows_carry_type_default_unit_constraints_and_an_example() -> None:
    class Probe(BaseModel):
        """A probe."""

        interval_s: float = Field(default=5.0, gt=0, le=600, description="Seconds between probes.")
        size_mb: int | None = Field(default=None, ge=1, description="Message size; None = off.")
        mode: Literal["ring", "tree"] = Field(default="ring", description="The algorithm.")
        host: str = Field(pattern=r"^[a-z]+$", max_length=63, description="Where.")

    class Root(BaseModel):
        probes: dict[str, Probe] = Field(default_factory=dict, description="Probes by name.")

    rows = {row.path: row for row in field_rows(Root, [{"probes": {"a": {"host": "node", "size_mb": 64}}}])}
    assert set(rows) == {"probes", *(f"probes.<key>.{n}" for n in ("interval_s", "size_mb", "mode", "host"))}
    interval, size, mode, host = (rows[f"probes.<key>.{n}"] for n in ("interval_s", "size_mb", "mode", "host"))
    assert (interval.type, interval.default, interval.unit) == ("float", "5.0", "seconds")
    assert interval.constraints == "> 0, <= 600"
    assert (size.type, size.default, size.unit, size.constraints) == ("int | None", "null", "megabytes", ">= 1")
    assert size.example == "64"  # from the example spec, not the default
    assert (mode.type, mode.example) == ('one of "ring", "tree"', '"ring"')
    assert host.default == "required" and host.example == '"node"'
    assert host.constraints == "length <= 63, pattern ^[a-z]+$"
    assert not rows["probes"].leaf and interval.leaf


def test_units_come_from_the_name_suffix_and_a_bounds_suffix_is_not_a_unit() -> None:
    assert unit_of("timeout_s") == "seconds"
    assert unit_of("p99_latency_ms_max") == "milliseconds"
    assert unit_of("bleu4_min") == ""
    assert unit_of("mem_per_node_mb") == "megabytes"


def test_the_page_has_a_table_per_section_with_escaped_cells() -> None:
    rows = field_rows(DeploymentSpec, load_examples(REPO / "examples"))
    page = render_markdown(rows)
    for section in ("top level", "cluster", "model", "parallel", "acceptance", "serve"):
        assert f"\n## {section}\n" in page
    slurm = next(line for line in page.splitlines() if line.startswith("| `cluster.slurm.mem_per_node_mb`<br>"))
    assert "unit: megabytes" in slurm and "constraints: `>= 1" in slurm and "`int | None`" in slurm
    assert "runs/&lt;name&gt;" in page  # deployment_dir's description: <name> is no HTML tag
