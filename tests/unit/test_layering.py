"""Layering: dependencies point one way, no import cycle joins the packages inside tasks/, and the training payload
runs without the orchestration stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

from tasks.spec import parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge


LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def test_import_contracts_hold() -> None:
    proc = subprocess.run([LINT_IMPORTS, str(REPO / "pyproject.toml")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


def _lint_toy_package(root: Path, modules: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """lint-imports over package `toy` (module path -> source) under pyproject's tasks/ cycle contract."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    [contract] = [c for c in config["contracts"] if c["type"] == "acyclic_siblings"]
    assert contract["ancestors"] == ["tasks"]
    settings: dict[str, Any] = {**config, "root_packages": ["toy"], "include_external_packages": False}
    del settings["contracts"]
    toy_contract = {**contract, "ancestors": ["toy"]}
    # JSON spells these strings, numbers, booleans and lists as TOML does.
    lines = ["[tool.importlinter]", *(f"{k} = {json.dumps(v)}" for k, v in settings.items())]
    lines += ["[[tool.importlinter.contracts]]", *(f"{k} = {json.dumps(v)}" for k, v in toy_contract.items())]
    (root / "pyproject.toml").write_text("\n".join(lines) + "\n")
    for name, source in {"toy/__init__.py": "", **modules}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(source))
    return subprocess.run(
        [LINT_IMPORTS, "--no-cache", str(root / "pyproject.toml")],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
    )


def test_tasks_cycle_contract_breaks_on_a_two_way_import_even_a_function_local_one(tmp_path: Path) -> None:
    proc = _lint_toy_package(
        tmp_path,
        {
            "toy/step/__init__.py": "",
            "toy/step/run.py": "from toy.spec import NAME\n",
            "toy/spec.py": "NAME = 'x'\n\ndef step():\n    from toy.step.run import NAME\n    return NAME\n",
        },
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "0 kept, 1 broken" in proc.stdout
    assert ".spec -> .step" in proc.stdout or ".step -> .spec" in proc.stdout, proc.stdout


def test_tasks_cycle_contract_allows_annotation_imports_and_cycles_inside_one_package(tmp_path: Path) -> None:
    proc = _lint_toy_package(
        tmp_path,
        {
            "toy/step/__init__.py": "",
            "toy/step/run.py": "from toy.step.result import Result\nfrom toy.spec import NAME\n",
            "toy/step/result.py": "class Result:\n    def run(self):\n        from toy.step.run import NAME\n",
            "toy/spec.py": """\
                from __future__ import annotations

                from typing import TYPE_CHECKING

                if TYPE_CHECKING:
                    from toy.step.result import Result
                NAME = 'x'
            """,
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 kept, 0 broken" in proc.stdout


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
