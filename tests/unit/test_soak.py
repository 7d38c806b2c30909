"""The soak's pure parts: the seeded failure schedule, the leak verdict against measured noise, which failures a
launcher can take, and the per-rung accounting of the result."""

from __future__ import annotations

import math
import os
import random
import statistics
import time
from pathlib import Path

import psutil
import pytest
from pydantic import ValidationError

from tasks.launch import registry
from tasks.launch.cluster import ClusterConfig
from tasks.soak.config import FAILURE_KINDS, SoakConfig
from tasks.soak.memory import (
    LEAK_FLOOR_FRACTION,
    MIN_SAMPLES,
    JobProcess,
    MemorySampler,
    ProcessMemory,
    Sample,
    first_step_after,
    judge,
    rank_step_times,
)
from tasks.soak.result import FailureOutcome, LossBand, SoakResult
from tasks.soak.run import left_out_kinds
from tasks.soak.schedule import failure_schedule

MIB = 2**20


def test_the_schedule_is_seeded_exponential_with_the_configured_mean_and_meets_every_kind() -> None:
    planned = failure_schedule(100_000.0, 60.0, FAILURE_KINDS, seed=5)
    assert planned == failure_schedule(100_000.0, 60.0, FAILURE_KINDS, seed=5)
    assert planned != failure_schedule(100_000.0, 60.0, FAILURE_KINDS, seed=6)
    gaps = [b.at_s - a.at_s for a, b in zip(planned, planned[1:])]
    # ~1650 exponential gaps of mean 60 s: the sample mean is within 10% (its standard error is 2.5%)
    assert statistics.mean(gaps) == pytest.approx(60.0, rel=0.1)
    assert statistics.stdev(gaps) == pytest.approx(60.0, rel=0.15)  # exponential: the spread equals the mean
    rounds = [planned[k : k + len(FAILURE_KINDS)] for k in range(0, len(planned) - 5, len(FAILURE_KINDS))]
    assert all(sorted(i.kind for i in r) == sorted(FAILURE_KINDS) for r in rounds)  # each kind once per round


def test_the_schedule_leaves_the_tail_quiet_and_holds_only_the_kinds_given() -> None:
    planned = failure_schedule(600.0, 20.0, ("rank_kill", "hang"), seed=1, tail_s=100.0)
    assert planned and max(i.at_s for i in planned) < 500.0
    assert {i.kind for i in planned} == {"rank_kill", "hang"}
    assert failure_schedule(600.0, 20.0, (), seed=1) == []


def _noisy(n: int, base: int, noise: int, slope: float = 0.0, seed: int = 0) -> list[int]:
    draw = random.Random(seed)
    return [int(base + slope * k + draw.uniform(-noise, noise)) for k in range(n)]


def _judge(rss: list[int], first_step: int | None = 0, pid: int = 1) -> ProcessMemory:
    """Judge RSS sampled once a second from t=0, the rank's first step recorded just before sample `first_step`."""
    samples = [Sample(float(k), r) for k, r in enumerate(rss)]
    return judge(pid, f"rank {pid}", samples, None if first_step is None else first_step - 0.5)


def test_a_steadily_growing_process_is_a_leak_and_a_noisy_flat_one_is_not() -> None:
    leaking = _judge(_noisy(60, 400 * MIB, MIB, slope=0.5 * MIB))
    assert leaking.verdict == "leak" and leaking.growth_bytes > leaking.tolerance_bytes
    flat = _judge(_noisy(60, 400 * MIB, 4 * MIB))
    assert flat.verdict == "steady"
    # the start-up, up to the first step, may grow as much as it likes
    warming = _judge([int(100 * MIB + k * 10 * MIB) for k in range(20)] + _noisy(40, 300 * MIB, MIB), first_step=20)
    assert warming.verdict == "steady" and warming.samples_judged == 40


def test_start_up_growth_up_to_a_late_first_step_is_no_leak_and_growth_after_it_is() -> None:
    # the false alarm of a short soak under load: a rank whose start-up (imports, build, restore on starved cores)
    # grew its RSS evenly for most of its short life, past the first third of its samples, up to its first step,
    # and stayed flat after it; the warm-up third's window held that growth and called it a leak
    draw = random.Random(4)
    start_up = [int((400 + k + draw.uniform(-0.3, 0.3)) * MIB) for k in range(40)]
    flat = [int((440 + draw.uniform(-0.3, 0.3)) * MIB) for _ in range(8)]
    short_lived = _judge(start_up + flat, first_step=40)
    assert short_lived.verdict == "steady" and short_lived.samples_judged == 8, short_lived.describe()
    # a true leak: the same start-up, then steady growth after the first step
    leak = _judge(start_up + _noisy(40, 440 * MIB, MIB // 4, slope=0.5 * MIB), first_step=40)
    assert leak.verdict == "leak" and leak.samples_judged == 40, leak.describe()


def test_a_rank_with_too_few_samples_after_its_first_step_is_not_judged() -> None:
    growing = [int((400 + 2 * k) * MIB) for k in range(40)]
    killed_early = _judge(growing, first_step=35)  # 5 samples after its first step
    assert killed_early.verdict == "short" and killed_early.growth_bytes is None
    assert "5 after its rank's first step: not enough samples to judge" in killed_early.describe()
    never_stepped = _judge(growing, first_step=None)
    assert never_stepped.verdict == "short" and never_stepped.samples_judged == 0


def test_a_process_is_judged_from_its_own_ranks_first_step_after_it_started() -> None:
    me = os.getpid()
    sampler = MemorySampler(lambda: {me: JobProcess("rank 3", 3)}, every_s=60.0)
    for _ in range(3):
        sampler.sample()
    stepped = time.time()
    time.sleep(0.01)
    for _ in range(MIN_SAMPLES):
        sampler.sample()
    started = psutil.Process(me).create_time()
    # an earlier process's step (before this one started) and another rank's steps do not open the window
    (verdict,) = sampler.verdicts({3: [started - 5.0, stepped, stepped + 100.0], 0: [started]})
    assert verdict.samples == 3 + MIN_SAMPLES and verdict.samples_judged == MIN_SAMPLES, verdict
    assert verdict.verdict in ("steady", "leak")
    assert first_step_after([started - 5.0], started) is None
    (unjudged,) = sampler.verdicts({0: [stepped]})
    assert unjudged.verdict == "short" and unjudged.samples_judged == 0


def test_the_step_times_are_read_per_rank_from_the_jobs_metrics(tmp_path: Path) -> None:
    from training.run_output import RunOutput, RunOutputWriter, StepRecord
    from training.storage import StorageConfig

    writer = RunOutputWriter(str(tmp_path), StorageConfig())
    for rank, step, at in [(0, 1, 10.0), (1, 1, 10.5), (0, 2, 11.0), (1, 1, 30.0)]:  # rank 1's step 1 run again
        writer.append_metrics(StepRecord(rank=rank, step=step, loss=1.0, time_unix_s=at))
    writer.append_metrics(StepRecord(rank=0, step=3, loss=1.0))  # no time: a run from before it was recorded
    writer.close()
    assert rank_step_times(RunOutput(tmp_path)) == {0: [10.0, 11.0], 1: [10.5, 30.0]}


def test_a_settling_process_is_no_leak_and_a_leak_on_top_of_settling_is() -> None:
    # a rank's RSS measured in a 3-minute soak: 443 -> 783 MiB, rising for minutes after its first steps, most in
    # the first of them (sampled every second; judged from the first step at 60 s, the rise left is ~75 MiB against
    # a ~30 MiB tolerance, which the straight-line test alone called a leak)
    draw = random.Random(3)
    settling = [int((443 + 340 * (1 - math.exp(-t / 50)) + draw.uniform(-1, 1)) * MIB) for t in range(180)]
    verdict = _judge(settling, first_step=60)
    assert verdict.growth_bytes > verdict.tolerance_bytes and verdict.verdict == "steady", verdict.describe()
    leaking = _judge([int(r + k * 0.5 * MIB) for k, r in enumerate(settling)], first_step=60)
    assert leaking.verdict == "leak", leaking.describe()


def test_growth_within_the_floor_or_a_single_spike_is_no_leak_and_short_lives_are_not_judged() -> None:
    small = _judge([100 * MIB + k * 1000 for k in range(60)])  # 60 kB over the run: below 2% of RSS
    assert small.verdict == "steady" and small.tolerance_bytes >= LEAK_FLOOR_FRACTION * 100 * MIB
    spike = _judge([100 * MIB] * 50 + [200 * MIB] + [100 * MIB] * 9)
    assert spike.verdict == "steady"
    assert _judge([100 * MIB] * 5).verdict == "short"


def test_failures_a_launcher_cannot_inject_are_left_out_with_the_reason() -> None:
    local = ClusterConfig(scheduler="local", nodes=1, procs_per_node=1)
    why = left_out_kinds(local, registry.capabilities("local"), FAILURE_KINDS)
    assert set(why) == {"node_loss", "hang", "slow_node"}
    assert why["node_loss"] == "needs cluster.nodes >= 2"
    two = ClusterConfig(scheduler="local", nodes=2, procs_per_node=1)
    assert left_out_kinds(two, registry.capabilities("local"), FAILURE_KINDS) == {}


def test_the_soak_config_refuses_a_kind_named_twice() -> None:
    with pytest.raises(ValidationError, match="names a failure twice"):
        SoakConfig(hours=1, failure_every_min=5, kinds=("hang", "hang"))


def test_the_result_counts_recoveries_per_rung_and_steps_lost() -> None:
    def outcome(kind, rung, expected, lost=0, problem=""):  # noqa: ANN001, ANN202
        return FailureOutcome(kind=kind, planned_at_s=1, injected_at_s=1, target="rank 1", at_step=10,
                              expected=expected, rung=rung, steps_lost=lost, problem=problem)  # fmt: skip

    failures = [outcome("rank_kill", "memory", ("memory",), 1), outcome("hang", "memory", ("memory",)),
                outcome("slow_node", "none", ("none",)), outcome("rank_kill", "storage", ("memory",), 4)]  # fmt: skip
    result = SoakResult(passed=False, scheduler="local", duration_s=60, mean_interval_s=30, seed=0,
                        memory_tier=True, failures=failures, left_out={}, steps_trained=100, goodput=None,
                        processes=[], loss=LossBand(first=5, last=3, low=3, high=5,
                        nonfinite_steps=0), problems=["x"], output_dir="/tmp/x")  # fmt: skip
    assert result.recoveries_per_rung == {"memory": 2, "none": 1}  # the storage restore was not the expected rung
    assert result.steps_lost == 5
    assert "3/4 failures recovered" in result.summary()


def test_tdeploy_soak_names_the_missing_and_the_bad_option_with_the_fix(tmp_path: Path) -> None:
    import yaml
    from typer.testing import CliRunner

    from flows.cli import app

    raw = yaml.safe_load(Path("examples/local.yaml").read_text())
    assert raw.pop("soak")["hours"] > 0  # the example's nightly soak
    no_soak = tmp_path / "no-soak.yaml"
    no_soak.write_text(yaml.safe_dump(raw))
    missing = CliRunner().invoke(app, ["soak", str(no_soak), "--failure-every", "1"])
    assert missing.exit_code == 2, missing.output
    assert "--hours not set; set it on the command line or in the spec's soak section" in missing.output
    bad = CliRunner().invoke(app, ["soak", "examples/local.yaml", "--hours", "0", "--failure-every", "1"])
    assert bad.exit_code == 2 and "--hours=0.0: Input should be greater than 0" in bad.output, bad.output


def test_the_soak_inputs_come_from_the_spec_and_survive_the_json_round_trip(tmp_path: Path) -> None:
    from tasks.soak.step import SoakInputs
    from tasks.spec import parse_spec
    from tests.conftest import TINY_SPEC, deep_merge

    paths = {"data": {"dataset_url": str(tmp_path / "ds")}, "checkpoint": {"url": str(tmp_path / "ck")},
             "run": {"output_url": str(tmp_path / "out")}, "soak": {"hours": 2, "failure_every_min": 10}}  # fmt: skip
    spec = parse_spec(deep_merge(TINY_SPEC, paths), "tiny")
    assert spec.soak is not None and spec.soak.mean_interval_s == 600 and spec.soak.duration_s == 7200
    inputs = SoakInputs.of(spec, spec.training_config(), spec.soak, work_url=str(tmp_path / "work"))
    assert SoakInputs.model_validate_json(inputs.model_dump_json()) == inputs
    assert Path(inputs.root).parent == tmp_path / "work" / "soak"
