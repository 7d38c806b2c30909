"""Data consistency on synthetic sample records: coverage by definition, exact epoch lengths, resumes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from training.run_output import EpochEnd, RunOutput, RunOutputWriter
from training.sampler import GlobalBatchSampler
from training.storage import StorageConfig
from validation.acceptance import DimensionResult
from validation.data_consistency import Sampling, check_data_consistency, with_resumed_run

# 101 samples, global batch 3 x 2 x 2 = 12: 8 steps per epoch and a remainder of 5 (padding: 7).
SAMPLING = Sampling(n_samples=101, micro_batch=3, grad_accum_steps=2, world_size=2, seed=5)

Record = dict[str, Any]


def _write_run(
    out: Path,
    sampling: Sampling,
    attempts: list[tuple[int | None, int]],
    *,
    sampler_cls: type[GlobalBatchSampler] = GlobalBatchSampler,
    resume_position: Callable[[int], int] = lambda step: step,
    mutate: Callable[[int, Record], Record | None] | None = None,
    mutate_end: Callable[[EpochEnd], EpochEnd] | None = None,
) -> Path:
    """Sample records as the trainer writes them; each attempt (resumed_from, last step) resumes from a checkpoint.

    A resumed attempt's samplers are restored to where the sampler stood after resume_position(resumed_from)
    steps (the identity: a correct checkpoint); `mutate` may change or drop a record, `mutate_end` an epoch end.
    """
    writer = RunOutputWriter(str(out), StorageConfig())
    for resumed_from, last in attempts:
        samplers = [
            sampler_cls(
                sampling.n_samples,
                sampling.micro_batch,
                sampling.grad_accum_steps,
                sampling.world_size,
                rank,
                sampling.seed,
                sampling.drop_last,
            )  # fmt: skip
            for rank in range(sampling.world_size)
        ]
        for sampler in samplers:  # the position a checkpoint of that step holds: stepped there, never normalised
            for _ in range(resume_position(resumed_from or 0)):
                sampler.next_step()
        for step in range((resumed_from or 0) + 1, last + 1):
            for rank, sampler in enumerate(samplers):
                epoch, micro = sampler.next_step()
                indices = [int(i) for m in micro for i in m]
                record = {
                    "step": step, "epoch": epoch, "offset": sampler.state.offset - sampler.global_batch,
                    "resumed_from": resumed_from, "indices": indices,
                }  # fmt: skip
                record = mutate(rank, record) if mutate else record
                if record is not None:
                    writer.append_samples(rank, record)
            first = samplers[0]
            if first.epoch_done:
                end = EpochEnd(
                    epoch, step, first.n_samples, first.global_batch,
                    first.remainder(epoch).tolist(), first.padding(epoch).tolist(),
                )  # fmt: skip
                writer.append_epoch(mutate_end(end) if mutate_end else end)
    writer.close()
    return out


def _check(tmp_path: Path, attempts: list[tuple[int | None, int]], sampling: Sampling = SAMPLING, **kw: Any):
    return check_data_consistency(_write_run(tmp_path / "out", sampling, attempts, **kw), sampling)


def test_a_clean_run_of_two_epochs_and_a_part_passes_and_checks_both_ended_epochs(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 20)])
    assert result.passed, result.message
    assert result.measured["epochs_complete_checked"] == [0, 1]
    assert result.measured["epochs"][0] == {
        "steps": 8, "expected_steps": 8, "ended": True, "seen": 96, "dropped": 5, "padded": 0,
    }  # fmt: skip
    assert result.measured["epochs"][2]["ended"] is False and result.threshold["remainder"] == 5


def test_a_run_that_ends_exactly_on_the_epoch_boundary_checks_that_epoch(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 8)])
    assert result.passed, result.message
    assert result.measured["epochs_complete_checked"] == [0]


def test_a_sampler_that_never_draws_one_sample_fails_coverage_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bug sits in the sampler itself, so a check that asked the sampler for the epoch would agree with it.
    honest = GlobalBatchSampler.permutation

    def skips_sample_7(self: GlobalBatchSampler, epoch: int) -> np.ndarray:
        order = honest(self, epoch)
        return np.where(order == 7, 8, order)

    monkeypatch.setattr(GlobalBatchSampler, "permutation", skips_sample_7)
    result = _check(tmp_path, [(None, 8)])
    assert not result.passed
    assert "epoch 0: 1 of the 101 training samples never seen and not in the recorded remainder: samples 7" in (
        result.message
    )


class _EndsEarly(GlobalBatchSampler):
    """Rolls over one batch before the epoch's end."""

    @property
    def epoch_done(self) -> bool:
        return self.state.offset + 2 * self.global_batch > self.n_samples


class _NeverDrops(GlobalBatchSampler):
    """Pads the last batch although drop_last is set."""

    @property
    def epoch_done(self) -> bool:
        return self.state.offset >= self.n_samples

    def next_step(self) -> tuple[int, list[np.ndarray]]:
        self.drop_last = False
        try:
            return super().next_step()
        finally:
            self.drop_last = True


def test_an_epoch_one_step_short_fails_saying_so(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 10)], sampler_cls=_EndsEarly)
    assert not result.passed
    assert "epoch 0 ran 7 steps, expected 8" in result.message
    assert "never seen" in result.message


def test_an_epoch_one_step_long_fails_saying_so(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 12)], sampler_cls=_NeverDrops)
    assert not result.passed
    assert "epoch 0 ran 9 steps, expected 8" in result.message


def test_an_epoch_in_progress_that_runs_long_fails(tmp_path: Path) -> None:
    def stays_in_epoch_0(rank: int, record: Record) -> Record:
        return {**record, "epoch": 0}

    # No epoch end recorded and no later epoch: epoch 0 is still in progress, and already one step too long.
    result = _check(tmp_path, [(None, 9)], mutate=stays_in_epoch_0, mutate_end=lambda end: replace(end, epoch=-1))
    assert result.measured["epochs"][0]["ended"] is False
    assert "epoch 0 ran 9 steps, expected 8" in result.message


def test_a_remainder_recorded_with_the_wrong_size_fails(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 8)], mutate_end=lambda end: replace(end, dropped=end.dropped[:-1]))
    assert not result.passed
    assert "the recorded remainder has 4 indices (4 distinct), expected n % global_batch = 101 % 12 = 5" in (
        result.message
    )


def test_a_remainder_that_was_also_seen_fails(tmp_path: Path) -> None:
    seen = int(GlobalBatchSampler(101, 3, 2, 2, 0, seed=5).next_step()[1][0][0])  # step 1's first sample
    result = _check(tmp_path, [(None, 8)], mutate_end=lambda end: replace(end, dropped=[*end.dropped[:-1], seen]))
    assert f"samples in the recorded remainder were seen too: {seen}" in result.message


def test_two_ranks_fed_the_same_samples_share_them(tmp_path: Path) -> None:
    rank0: dict[int, list[int]] = {}

    def copy_rank0(rank: int, record: Record) -> Record:
        if rank == 0:
            rank0[record["step"]] = record["indices"]
            return record
        return {**record, "indices": rank0[record["step"]]}

    result = _check(tmp_path, [(None, 4)], mutate=copy_rank0)
    assert "epoch 0: ranks 0 and 1 share 24 samples" in result.message


def test_a_clean_resume_across_an_epoch_boundary_passes(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 7), (4, 20)])
    assert result.passed, result.message
    assert result.measured["attempts"] == {0: 2, 1: 2} and result.measured["resumed_from_steps"] == [4]
    assert result.measured["epochs_after_resume"] == [0, 1, 2]


def test_a_resume_from_an_older_sampler_position_repeats_samples_and_fails(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 7), (4, 12)], resume_position=lambda step: step - 2)
    assert not result.passed
    assert "rank 0: step 5, the first after the resume from step 4, was fed epoch 0 offset 24" in result.message
    assert "the uninterrupted order gives epoch 0 offset 48" in result.message
    assert "rank 0: steps 5, 6, 7 were fed other samples when they ran again after the resume from step 4" in (
        result.message
    )


def test_a_resume_that_skips_samples_fails_the_order_and_the_coverage(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 4), (4, 12)], resume_position=lambda step: step + 1)
    assert not result.passed
    assert "step 5, the first after the resume from step 4" in result.message
    assert "never seen" in result.message


def test_a_resume_that_skips_a_step_fails(tmp_path: Path) -> None:
    def drop_resumed_step_5(rank: int, record: Record) -> Record | None:
        return None if record["resumed_from"] == 4 and record["step"] == 5 else record

    result = _check(tmp_path, [(None, 4), (4, 12)], mutate=drop_resumed_step_5)
    assert not result.passed
    assert "rank 0: the resume from step 4 began at step 6, expected step 5" in result.message
    assert "rank 0: steps missing from the sample records: 5" in result.message


def test_steps_skipped_inside_one_attempt_fail(tmp_path: Path) -> None:
    result = _check(tmp_path, [(None, 12)], mutate=lambda rank, rec: None if rec["step"] in (3, 4) else rec)
    assert "rank 0: step 5 follows step 2 (steps skipped)" in result.message


def test_without_drop_last_every_sample_is_seen_and_the_padding_repeats(tmp_path: Path) -> None:
    padded = replace(SAMPLING, drop_last=False)
    result = _check(tmp_path, [(None, 20)], padded)
    assert result.passed, result.message
    assert result.measured["epochs"][0] == {
        "steps": 9, "expected_steps": 9, "ended": True, "seen": 101, "dropped": 0, "padded": 7,
    }  # fmt: skip
    assert result.threshold["padding"] == 7 and "plus the recorded padding" in result.threshold["coverage"]


def test_without_drop_last_a_wrong_padding_record_fails(tmp_path: Path) -> None:
    padded = replace(SAMPLING, drop_last=False)
    result = _check(tmp_path, [(None, 9)], padded, mutate_end=lambda end: replace(end, padded=end.padded[:3]))
    assert "the recorded padding has 3 indices (3 distinct), expected (-n) % global_batch = (-101) % 12 = 7" in (
        result.message
    )
    assert "samples seen more than once" in result.message


def test_the_padding_sampler_covers_each_epoch_and_resumes_from_its_position() -> None:
    samplers = [GlobalBatchSampler(101, 3, 2, 2, r, seed=5, drop_last=False) for r in range(2)]
    assert samplers[0].steps_per_epoch == 9
    seen: list[int] = []
    for _ in range(9):
        for sampler in samplers:
            epoch, micro = sampler.next_step()
            assert epoch == 0
            seen += np.concatenate(micro).tolist()
    assert sorted(set(seen)) == list(range(101)) and len(seen) == 108
    assert samplers[0].epoch_done and sorted(samplers[0].padding(0).tolist()) == sorted(
        i for i in set(seen) if seen.count(i) == 2
    )
    fresh = GlobalBatchSampler(101, 3, 2, 2, 0, seed=5, drop_last=False)
    fresh.state = fresh.position(9)
    assert fresh.next_step()[1][0].tolist() == samplers[0].next_step()[1][0].tolist()


def test_a_resumed_run_folds_into_the_dimension_and_must_show_a_resume(tmp_path: Path) -> None:
    clean = _check(tmp_path / "a", [(None, 10)])
    resumed = _check(tmp_path / "b", [(None, 7), (4, 10)])
    merged = with_resumed_run(clean, resumed)
    assert merged.passed and merged.measured["resume"]["resumed_from_steps"] == [4]
    assert merged.evidence["resume"]["records"].endswith("samples")
    unresumed = with_resumed_run(clean, clean)
    assert not unresumed.passed and "its sample records show no resume" in unresumed.message
    broken = DimensionResult(
        name="data_consistency", passed=False, measured=resumed.measured, message="epoch 0 ran 7 steps, expected 8"
    )
    failed = with_resumed_run(clean, broken)
    assert not failed.passed and failed.message == "resumed run: epoch 0 ran 7 steps, expected 8"


def test_the_reader_keeps_every_attempt_in_order(tmp_path: Path) -> None:
    out = _write_run(tmp_path / "out", SAMPLING, [(None, 3), (1, 3)])
    steps = [r["step"] for r in RunOutput(out).sample_records(1)]
    assert steps == [1, 2, 3, 2, 3]
    assert sorted(RunOutput(out).all_samples()[1]) == [1, 2, 3]
