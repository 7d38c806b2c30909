"""The spec reference: every field of a pydantic model tree (DeploymentSpec) as rows, and those rows as markdown.

The documentation site's hook (docs/hooks/spec_reference.py) renders the reference page from here at build time;
a field without a description is an error, so the reference cannot silently fall behind the models.
"""

from __future__ import annotations

import json
import re
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tasks.errors import UserError

# A field's unit, from the suffix of its name (STYLE.md: a unit in the name where it has one); longest first.
UNITS: dict[str, str] = {
    "_per_s": "per second",
    "_ms": "milliseconds",
    "_s": "seconds",
    "_minutes": "minutes",
    "_hours": "hours",
    "_days": "days",
    "_bytes": "bytes",
    "_kb": "kilobytes",
    "_mb": "megabytes",
    "_gb": "gigabytes",
    "_gib": "gibibytes",
    "_mbit": "megabits per second",
    "_gbps": "gigabits per second",
    "_gbit": "gigabits per second",
    "_tflops": "teraFLOP/s",
    "_steps": "steps",
    "_tokens": "tokens",
    "_pct": "percent",
    "_percent": "percent",
    "_fraction": "fraction (0-1)",
    "_ratio": "ratio",
    "_mib": "mebibytes",
}
TOP_LEVEL = "top level"
_SUFFIXES = sorted(UNITS, key=len, reverse=True)
_CONSTRAINTS: dict[type, tuple[str, str]] = {
    annotated_types.Ge: (">=", "ge"),
    annotated_types.Gt: (">", "gt"),
    annotated_types.Le: ("<=", "le"),
    annotated_types.Lt: ("<", "lt"),
    annotated_types.MinLen: ("length >=", "min_length"),
    annotated_types.MaxLen: ("length <=", "max_length"),
    annotated_types.MultipleOf: ("multiple of", "multiple_of"),
}


class UndescribedFields(UserError, ValueError):
    """Fields of the spec without a description: the reference (and the docs build) refuses them."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        super().__init__(
            f"{len(paths)} spec field(s) without a description: {', '.join(paths)}; "
            "give each Field(description=...) in its model (a sub-model's class docstring also counts)"
        )


@dataclass(frozen=True)
class FieldRow:
    """One field of the spec: its dotted path and what a person needs to fill it in."""

    path: str
    type: str
    default: str
    unit: str
    description: str
    constraints: str
    example: str
    leaf: bool

    @property
    def section(self) -> str:
        """The top-level section the field belongs to (`cluster` for `cluster.slurm.partition`)."""
        return re.split(r"[.\[]", self.path, maxsplit=1)[0]


def unit_of(name: str) -> str:
    """The unit a field's name carries in its suffix (`timeout_s` -> seconds), or '' without one."""
    name = re.sub(r"_(min|max)$", "", name)  # a bound's suffix: p99_latency_ms_max is in milliseconds
    return next((UNITS[s] for s in _SUFFIXES if name.endswith(s)), "")


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """An annotation without its Annotated wrappers, and the metadata they carried."""
    metadata: list[Any] = []
    while get_origin(annotation) is Annotated:
        annotation, *extra = get_args(annotation)
        metadata.extend(extra)
    return annotation, metadata


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: Any) -> str:
    """A short, readable name of a type annotation: `int | None`, `list[str]`, `one of a, b`."""
    annotation, _ = _unwrap(annotation)
    origin = get_origin(annotation)
    if annotation is type(None):
        return "None"
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(a) for a in get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(info: FieldInfo, annotation: Any) -> str:
    metadata = list(info.metadata)
    stack = [annotation]
    while stack:  # constraints inside aliases (PositiveInt, LocalPath = Annotated[str, ...]) and Optional[...]
        inner, extra = _unwrap(stack.pop())
        metadata.extend(extra)
        if get_origin(inner) in (Union, types.UnionType):
            stack.extend(get_args(inner))
    parts: list[str] = []
    for item in metadata:
        for kind, (symbol, attr) in _CONSTRAINTS.items():
            if isinstance(item, kind):
                parts.append(f"{symbol} {getattr(item, attr)}")
        pattern = getattr(item, "pattern", None)
        if isinstance(pattern, str):
            parts.append(f"pattern {pattern}")
    return ", ".join(dict.fromkeys(parts))


def _json(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
        return "(see below)" if value else "{}"
    if isinstance(value, Path):
        value = str(value)
    try:
        return json.dumps(value, default=str)
    except TypeError:
        return str(value)


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        return _json(info.get_default(call_default_factory=True, validated_data={}))
    return _json(info.default)


def _models(annotation: Any) -> Iterator[tuple[str, type[BaseModel]]]:
    """The models inside an annotation with the path suffix that reaches them: '' directly, '[]' in a list, ..."""
    annotation, _ = _unwrap(annotation)
    if _is_model(annotation):
        yield "", annotation
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Union, types.UnionType):
        for arg in args:
            yield from _models(arg)
    elif origin in (list, tuple, set, frozenset) and args:
        for arg in args:
            for suffix, model in _models(arg):
                yield "[]" + suffix, model
    elif origin is dict and len(args) == 2:
        for suffix, model in _models(args[1]):
            yield ".<key>" + suffix, model


def _description(info: FieldInfo, models: list[type[BaseModel]]) -> str:
    if info.description:
        return " ".join(info.description.split())
    docs = [m.__doc__ for m in models if m.__doc__ and m.__doc__.strip() and m.__doc__ is not BaseModel.__doc__]
    return " ".join(docs[0].split()) if len(docs) == 1 and len(models) == 1 else ""


def _lookup(examples: list[Any], path: list[str]) -> Any:
    for spec in examples:
        value: Any = spec
        for key in path:
            if key == "[]" or key == "<key>":
                value = (value[0] if isinstance(value, list) and value else
                         next(iter(value.values()), None) if isinstance(value, dict) else None)
                continue
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            return value
    return None


def _example(info: FieldInfo, annotation: Any, found: Any, default: str) -> str:
    if found is not None and not isinstance(found, dict):
        return _json(found)
    if default not in ("required", "null", "{}", "[]", '""', "(see below)"):
        return default
    inner, _ = _unwrap(annotation)
    candidates = [inner]
    if get_origin(inner) in (Union, types.UnionType):
        candidates = [a for a in get_args(inner) if a is not type(None)]
    first, _ = _unwrap(candidates[0]) if candidates else (None, [])
    if get_origin(first) is Literal:
        return json.dumps(get_args(first)[0])
    if _is_model(first):
        return "(see below)"
    bounds = {a: getattr(m, a) for m in info.metadata for a in ("ge", "gt") if getattr(m, a, None) is not None}
    if first is int:
        return str(int(bounds.get("ge", bounds.get("gt", 0) + 1)))
    if first is float:
        return str(float(bounds.get("ge", bounds.get("gt", 0) + 1)))
    if first is bool:
        return "true"
    if first is str:
        return json.dumps("...")
    return default if default != "required" else "..."


def field_rows(model: type[BaseModel], examples: list[Mapping[str, Any]] | None = None) -> list[FieldRow]:
    """Every field of `model`, recursively (sub-models, unions, lists and dicts of models), in declaration order.

    `examples` are parsed specs whose values serve as each field's example. Raises UndescribedFields naming every
    field without a description.
    """
    rows: list[FieldRow] = []
    missing: list[str] = []
    specs = list(examples or [])

    def walk(current: type[BaseModel], prefix: str, keys: list[str], seen: tuple[type[BaseModel], ...]) -> None:
        for name, info in current.model_fields.items():
            path, path_keys = f"{prefix}{name}", [*keys, name]
            nested = list(_models(info.annotation))
            models = [m for _, m in nested]
            description = _description(info, models)
            if not description:
                missing.append(path)
            default = _default(info)
            found = _lookup(specs, path_keys)
            rows.append(
                FieldRow(
                    path=path,
                    type=type_name(info.annotation),
                    default=default,
                    unit=unit_of(name),
                    description=description,
                    constraints=_constraints(info, info.annotation),
                    example=_example(info, info.annotation, found, default),
                    leaf=not nested,
                )
            )
            for suffix, sub in nested:
                if sub in seen:
                    continue
                sub_keys = path_keys + [k for k in re.findall(r"\[\]|<key>", suffix)]
                walk(sub, f"{path}{suffix}.", sub_keys, (*seen, sub))

    walk(model, "", [], (model,))
    if missing:
        raise UndescribedFields(missing)
    return rows


def load_examples(folder: Path) -> list[dict[str, Any]]:
    """The example specs under `folder` as plain data (the reference's example values), local.yaml first."""
    paths = sorted(folder.glob("*.yaml"), key=lambda p: (p.name != "local.yaml", p.name))
    loaded = [yaml.safe_load(p.read_text()) for p in paths]
    return [spec for spec in loaded if isinstance(spec, dict)]


def _anchor(heading: str) -> str:
    """The anchor Python-Markdown's toc extension gives a heading (lower case, spaces to dashes)."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _text(text: str) -> str:
    """Prose for a table cell: markdown's special characters escaped outside `code` spans."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):  # the even parts lie outside code spans
        parts[i] = re.sub(r"([\\*_\[\]])", r"\\\1", parts[i]).replace("<", "&lt;").replace(">", "&gt;")
    return _cell("`".join(parts))


def _code(text: str) -> str:
    if not text:
        return ""
    if "`" in text:
        return _cell(text)
    return f"`{text}`"  # the tables extension does not split a cell at a pipe inside a code span


def render_markdown(rows: list[FieldRow], title: str = "Spec reference") -> str:
    """The rows as a markdown page: one table per top-level section, every field with its facts."""
    lines = [
        f"# {title}",
        "",
        "Generated from the pydantic models of `tasks.spec.DeploymentSpec` (`tasks/spec_reference.py`) each time "
        "the site builds: every field, its dotted path (`[]` is an item of a list, `<key>` any key of a mapping), "
        "type, default, unit (from the name's suffix), constraints, an example value (from `examples/*.yaml` where "
        "one sets it) and its description. `null` means off. `tdeploy schema` writes the same models as a JSON "
        "Schema for editors.",
        "",
    ]
    sections: dict[str, list[FieldRow]] = {}
    for row in rows:
        top_level_value = row.leaf and row.section == row.path
        sections.setdefault(TOP_LEVEL if top_level_value else row.section, []).append(row)
    lines.append("Sections: " + ", ".join(f"[{name}](#{_anchor(name)})" for name in sections) + ".")
    lines.append("")
    for name, section in sections.items():
        about = "The spec's own fields." if name == TOP_LEVEL else section[0].description
        lines += [f"## {name}", "", _text(about), ""]
        lines += ["| field and type | default and example | description |", "|---|---|---|"]
        for row in section:
            facts = [f"unit: {row.unit}" if row.unit else "", f"constraints: {_code(row.constraints)}"
                     if row.constraints else ""]  # fmt: skip
            extra = "<br>" + "; ".join(f for f in facts if f) if any(facts) else ""
            lines.append(
                f"| `{row.path}`<br>{_code(row.type)} | {_code(row.default)}<br>example: {_code(row.example)} | "
                f"{_text(row.description)}{extra} |"
            )
        lines.append("")
    return "\n".join(lines)


def spec_reference(examples_dir: Path | None = None) -> str:
    """The reference page of DeploymentSpec, with example values from `examples_dir` (the repository's examples)."""
    from tasks.spec import DeploymentSpec  # tasks.spec imports most of tasks/: loaded only when asked for

    examples = load_examples(examples_dir) if examples_dir is not None else []
    return render_markdown(field_rows(DeploymentSpec, examples))
