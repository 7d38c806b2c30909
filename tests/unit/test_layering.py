"""Layering: dependencies point one way, and the training payload runs without the orchestration stack."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tasks.spec import parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge


def test_import_contracts_hold() -> None:
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("lint-imports")), str(REPO / "pyproject.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout


def test_training_payload_trains_with_prefect_ansible_and_great_expectations_unimportable(
    tmp_path: Path, tiny_dataset: str
) -> None:
    spec = parse_spec(
        deep_merge(
            TINY_SPEC,
            {
                "cluster": {"procs_per_node": 1},
                "data": {"dataset_url": tiny_dataset},
                "checkpoint": {"url": str(tmp_path / "ckpt"), "save_every_steps": 2},
                "run": {"steps": 3, "output_url": str(tmp_path / "out")},
            },
        )
    )
    spec.training_config().to_json_file(tmp_path / "run.json")
    script = textwrap.dedent(
        f"""
        import sys
        BLOCKED = ("prefect", "ansible_runner", "ansible", "great_expectations", "typer", "rich", "tasks", "flows")
        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is blocked: the payload must not need it")
        sys.meta_path.insert(0, Blocker())
        from training.train import main
        main(["--config", {str(tmp_path / "run.json")!r}])
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "result.json").read_text())["steps"] == 3
