"""Small hostile inputs end in a clear error that names the value, never a traceback (issue 39, item 10)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from flows.cli import app
from tasks.spec import SpecError, parse_spec_text
from tests.conftest import TINY_SPEC, deep_merge
from training.storage import check_storage_url


def test_a_five_thousand_digit_integer_is_a_spec_error_with_its_line() -> None:
    text = "name: big\nrun:\n  seed: " + "7" * 5000 + "\n"
    with pytest.raises(SpecError) as caught:
        parse_spec_text(text, "big.yaml")
    assert "line 3, column 9: an integer of 5000 digits; no spec field takes more than 64" in str(caught.value)


def test_an_integer_of_ordinary_length_still_parses() -> None:
    import yaml

    spec = parse_spec_text(yaml.safe_dump(deep_merge(TINY_SPEC, {"run": {"seed": 4294967295}})))
    assert spec.run.seed == 4294967295


@pytest.mark.parametrize("url", ["   ", "\t", " runs/x", "runs/x "])
def test_blank_or_space_padded_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="blank|white space|control character"):
        check_storage_url(url)


def test_a_blank_folder_in_a_spec_is_refused_with_its_field() -> None:
    import yaml

    with pytest.raises(SpecError) as caught:
        parse_spec_text(yaml.safe_dump(deep_merge(TINY_SPEC, {"run": {"output_url": "   "}})))
    assert 'run.output_url="   ": must not be empty or blank' in str(caught.value)


@pytest.mark.parametrize("target", ["node1:²", "nöde:٣", "node1:0", "node1:65536", "node1", ":9400"])
def test_alerts_render_refuses_a_target_that_is_not_ascii_host_and_port(target: str, tmp_path) -> None:  # noqa: ANN001
    out = CliRunner().invoke(
        app,
        ["alerts", "render", "--critical-url", "http://127.0.0.1:9095/c", "--warning-url", "http://127.0.0.1:9095/w",
         "--training-target", target, "--out", str(tmp_path / "monitoring")],
    )  # fmt: skip
    assert out.exit_code == 2, out.output
    assert f"target={target!r} is not host:port" in out.output
    assert "Traceback" not in out.output
