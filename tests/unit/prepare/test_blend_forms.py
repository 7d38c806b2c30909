"""A Megatron/NeMo blend is taken in every form megatron-core's `get_blend_from_list` takes: weights as numbers or
as strings (`["30", A, "70", B]`, as argparse hands them over), and `--data-path 0.3 A 0.7 B` pasted as one string."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tasks.preflight import preflight
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge


def _spec_data(tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
    paths = {"checkpoint": {"url": str(tmp_path / "c")}, "run": {"output_url": str(tmp_path / "o")}}
    out = deep_merge(TINY_SPEC, paths)
    out["data"] = data
    return out


def _prefixes(tmp_path: Path) -> tuple[str, str]:
    """Two Megatron prefixes (P.bin and P.idx beside each other): enough for the path check."""
    a, b = tmp_path / "a_text_document", tmp_path / "b_text_document"
    for prefix in (a, b):
        for suffix in (".bin", ".idx"):
            Path(f"{prefix}{suffix}").touch()
    return str(a), str(b)


@pytest.mark.parametrize(
    ("form", "weights"),
    [
        ("string weights", [30.0, 70.0]),
        ("pasted --data-path", [0.3, 0.7]),
        ("number weights", [0.3, 0.7]),
    ],
)
def test_a_megatron_blend_is_read_in_each_form_its_own_reader_takes(
    tmp_path: Path, form: str, weights: list[float]
) -> None:
    a, b = _prefixes(tmp_path)
    given: Any = {
        "string weights": ["30", a, "70", b],
        "pasted --data-path": f"0.3 {a} 0.7 {b}",
        "number weights": [0.3, a, 0.7, b],
    }[form]
    for field in ("dataset_url", "blend"):
        spec = parse_spec(_spec_data(tmp_path, {field: given}))
        assert spec.data.blend is not None and spec.data.dataset_url is None
        assert [(s.url, s.weight) for s in spec.data.blend] == list(zip([a, b], weights, strict=True))
        preflight(spec)  # the paths it checks are the prefixes, not `30`


def test_a_plain_path_with_a_space_stays_one_path(tmp_path: Path) -> None:
    spec = parse_spec(_spec_data(tmp_path, {"dataset_url": "/data/my corpus/a_text_document"}))
    assert spec.data.dataset_url == "/data/my corpus/a_text_document" and spec.data.blend is None
