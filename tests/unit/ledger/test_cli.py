"""`tdeploy history` and `tdeploy baseline` on a ledger of hand-made entries (no jobs)."""

from __future__ import annotations

from pathlib import Path

import yaml
from typer.testing import CliRunner

from flows.cli import app
from flows.cli.common import EXIT_FAILED_CHECK, EXIT_USER_ERROR
from tasks.ledger.registry import Ledger
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.ledger.conftest import figures


def _spec_file(tmp_path: Path, tiny_dataset: str, ledger: Ledger) -> str:
    overrides = {
        "name": "tiny",
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(tmp_path / "ck")},
        "run": {"output_url": str(tmp_path / "out")},
        "acceptance": {"ledger_url": ledger.url},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(deep_merge(TINY_SPEC, overrides)))
    return str(path)


def test_history_lists_each_entry_with_the_current_baseline_and_rolled_back_ones_marked(
    tmp_path: Path, tiny_dataset: str, ledger: Ledger, make_entry
) -> None:
    first, second = make_entry(), make_entry()
    ledger.append(first)
    ledger.append(second)
    ledger.mark_rolled_back([second.entry_id], first.entry_id)
    result = CliRunner().invoke(app, ["history", _spec_file(tmp_path, tiny_dataset, ledger)], terminal_width=300)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(first.entry_id) and lines[0].endswith("[current baseline]")
    assert "tokens/s 1000" in lines[0] and "final loss 3.0000" in lines[0] and "code 0.1.0+gabcdef123456" in lines[0]
    assert lines[1].startswith(second.entry_id) and lines[1].endswith(f"[rolled back to {first.entry_id}]")


def test_baseline_shows_the_diff_to_an_entry_and_fails_on_a_regression(
    tmp_path: Path, tiny_dataset: str, ledger: Ledger, make_entry
) -> None:
    base, slow = make_entry(), make_entry(figures=figures(tokens_per_s=850.0))
    ledger.append(base)
    spec = _spec_file(tmp_path, tiny_dataset, ledger)
    result = CliRunner().invoke(app, ["baseline", spec, "--run", slow.entry_id], terminal_width=300)
    assert result.exit_code == 2, result.output  # not in the ledger: a one-line error naming it
    ledger.append(slow)
    ledger.mark_rolled_back([slow.entry_id], base.entry_id)  # the slow one is not the baseline
    result = CliRunner().invoke(app, ["baseline", spec, "--run", slow.entry_id], terminal_width=300)
    assert result.exit_code == EXIT_FAILED_CHECK, result.output
    assert f"current baseline: {base.entry_id}" in result.output
    assert "tokens/s 850 is 15% below the baseline's 1000" in result.output
    bad = CliRunner().invoke(app, ["baseline", spec, "--run", str(tmp_path / "nowhere")])
    assert bad.exit_code == EXIT_USER_ERROR and "no such folder or ledger entry" in bad.output
