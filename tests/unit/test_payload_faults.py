"""The payload carries drill points only: the tests' bugs live in tests/faults/ and reach a job from its import path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from tests.faults import payload
from tests.faults.bugs import TestFaults
from tests.faults.job import HARNESS, ROOT, injected

TRAINING = ROOT / "training"
# The bug simulators' names as the payload used to spell them (training/faults.py before it left the payload).
SIMULATOR_NAMES = {
    "accum_bug", "skip_grad_sync", "loss_poison", "nan_at_step", "maybe_slow_down", "step_computed", "slow_rank",
    "maybe_crash", "maybe_pause", "stops_after", "maybe_kill_during_save", "maybe_break_save", "save_bug_rank",
    "commit_before_extras", "checkpoint_without_optimizer", "sample_rank", "sample_order", "sampler_skip_index",
    "scale_lr", "lr_scale", "seed_for", "seed_offset_rank", "maybe_reseed_tp_shards", "tp_shard_seed", "TestFaults",
    "TDEPLOY_TEST_FAULTS", "faults",
}  # fmt: skip


def _names(tree: ast.AST) -> set[str]:
    """Every identifier, attribute, imported name and string constant of a module."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.update(node.name.split("."))
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(node.module.split("."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
            found.add(node.value)
    return found


def test_no_module_of_the_payload_names_a_test_fault() -> None:
    offenders = {}
    for path in sorted(TRAINING.rglob("*.py")):
        hits = _names(ast.parse(path.read_text())) & SIMULATOR_NAMES
        if hits:
            offenders[str(path.relative_to(ROOT))] = sorted(hits)
    assert not (TRAINING / "faults.py").exists()
    assert offenders == {}, f"test-fault hooks in the payload: {offenders}"


def test_every_bug_a_test_can_ask_for_is_applied_by_the_harness() -> None:
    source = Path(payload.__file__).read_text()
    unapplied = [name for name in TestFaults.model_fields if f"faults.{name}" not in source]
    assert unapplied == []


def _patched_in_a_fresh_process(env: dict[str, str]) -> str:
    """Where the sampler's permutation comes from in a new Python process started with `env`."""
    probe = "from training.sampler import GlobalBatchSampler; print(GlobalBatchSampler.permutation.__module__)"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TORCHELASTIC_RESTART_COUNT")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env={**clean, **env}, cwd=ROOT, capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_the_harness_patches_a_jobs_first_attempt_and_leaves_a_restarted_one_clean() -> None:
    variables = injected(sampler_skip_index=3).variables()
    assert variables["PYTHONPATH"].split(os.pathsep)[0] == str(HARNESS)
    assert _patched_in_a_fresh_process(variables) == payload.__name__
    assert _patched_in_a_fresh_process({**variables, "TORCHELASTIC_RESTART_COUNT": "1"}) == "training.sampler"
    assert _patched_in_a_fresh_process({}) == "training.sampler"
