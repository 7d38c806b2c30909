"""checkpoint.save_every_steps=auto on real one-process runs: with a failure rate the trainer saves first after
FIRST_SAVE_STEP steps and then at the Young/Daly optimum of its measured stall; without one it saves only at the
end, as the suite's specs did before auto existed.

An MTBF far below any real stall (1 microsecond) makes Daly's optimum the MTBF itself, under one step: the trainer
must then save at every step after its first save, whatever this machine's timings, which proves the interval
came from the measured stall and the failure rate, not from a constant."""

from __future__ import annotations

import pytest

from tasks.launch.local import run_local
from training.checkpoint.save_auto import FIRST_SAVE_STEP
from training.run_output import RunOutput

pytestmark = pytest.mark.integration
STEPS = FIRST_SAVE_STEP + 4


def _saved_steps(make_spec, name: str, checkpoint: dict) -> list[int]:  # noqa: ANN001
    spec = make_spec({"cluster": {"procs_per_node": 1}, "run": {"steps": STEPS},
                      "checkpoint": {"save_every_steps": "auto", "keep_last": 1, **checkpoint}}, name=name)  # fmt: skip
    job = run_local(spec.cluster, spec.training_config())  # raises unless the job succeeded
    return sorted(c.step for c in RunOutput(job.output_dir).checkpoints() if c.error is None)


def test_auto_saves_at_the_optimum_of_the_measured_stall_with_a_failure_rate_and_at_the_end_without(make_spec) -> None:
    assert _saved_steps(make_spec, "rate", {"mtbf_s": 1e-6}) == list(range(FIRST_SAVE_STEP, STEPS + 1))
    assert _saved_steps(make_spec, "unknown", {}) == [STEPS]
