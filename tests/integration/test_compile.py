"""run.compile: the blocks compiled with torch.compile (inductor, on this CPU) train to the eager losses, and the
checkpoint keeps the eager model's keys."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.checkpoint import FileSystemReader

from tests.conftest import metrics_by_step, run_lone_process

pytestmark = pytest.mark.integration


def test_compiled_blocks_give_the_eager_losses_and_the_same_checkpoint_keys(make_spec) -> None:
    runs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        spec = make_spec({"run": {"steps": 4, "compile": compiled}, "checkpoint": {"save_every_steps": 4}}, name=name)
        run_lone_process(spec)
        runs[name] = spec
    eager, compiled = (metrics_by_step(runs[n].run.output_url) for n in ("eager", "compiled"))
    assert sorted(compiled) == [1, 2, 3, 4]
    for step in range(1, 5):  # kernels fuse differently: the same losses to float32 rounding, not bit for bit
        assert compiled[step].loss == pytest.approx(eager[step].loss, rel=1e-4), step
    assert compiled[4].grad_norm == pytest.approx(eager[4].grad_norm, rel=1e-3)
    keys = {}
    for name, spec in runs.items():
        step_dir = Path(spec.checkpoint.url) / "step-00000004"
        keys[name] = set(FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata)
    assert keys["compiled"] == keys["eager"]  # no _orig_mod. prefix: a compiled run's checkpoint loads eagerly
    assert any(key.startswith("model.blocks.0.") for key in keys["compiled"]), sorted(keys["compiled"])[:5]
