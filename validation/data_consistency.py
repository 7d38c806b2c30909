"""Data consistency: each epoch covers the training split, ranks never share a sample, resumes continue the order.

Coverage is by definition, not by the sampler under test: an epoch is every sample index
0..n-1 of the training split (n is the dataset's own length), minus the remainder the trainer
recorded as dropped where `data.drop_last` leaves the last partial global batch out. That
remainder must hold exactly n % global_batch indices, none of them seen in its epoch. Without
drop_last the epoch's last batch is padded instead: every index is seen once and the recorded
padding ((-n) % global_batch indices) once more.

Every epoch that ended (a later one started, or the trainer recorded its end) is checked for
coverage and must have run exactly the steps the definition gives (n // global_batch, or the
ceiling when padding); the epoch still in progress is checked for repeats and for running long.

Resumes are read from every attempt's records (`RunOutput.sample_records`): per rank, an attempt
begins at the step after the checkpoint it resumed from, fed what the uninterrupted order gives
at that step; a step that more than one attempt ran was fed the same samples each time; no step
is missing. Coverage and overlap count each step once.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from training.config import TrainConfig
from training.layout import data_parallel_degree
from training.run_output import EPOCHS, SAMPLES_DIR, EpochEnd, RunOutput
from training.sampler import Blend, GlobalBatchSampler
from training.workload import workload_of
from validation.acceptance import DimensionResult

_SHOWN = 5  # sample indices or steps quoted in a message


@dataclass(frozen=True)
class Sampling:
    """How a run draws samples: the training split's length (from the dataset itself) and the sampler settings."""

    n_samples: int
    micro_batch: int
    grad_accum_steps: int
    world_size: int  # data-parallel ranks: the sample records' ranks (tensor and pipeline peers share one)
    seed: int
    drop_last: bool = True
    blend: Blend | None = None
    """A blend of weighted sources: n_samples counts its draws per epoch, which resolve to samples per source."""
    weights: tuple[float, ...] | None = None
    """The blend's weights as the dataset's manifest defines them (not as the trainer's Blend applies them): each
    source's expected share of every epoch's draws. Required with a blend."""
    source_samples: tuple[int, ...] | None = None
    """Samples of each source in the dataset (its shards' own counts): which source a fed sample belongs to."""

    def __post_init__(self) -> None:
        if self.blend is not None and (self.weights is None or self.source_samples is None):
            raise ValueError("a blend's sampling needs the manifest's weights and the sources' sample counts")

    @classmethod
    def of(cls, train: TrainConfig, world_size: int) -> Sampling:
        """The sampling of a run of `train` on `world_size` processes (opens the training split for its length).

        Samples are drawn per data-parallel rank: a model-parallel layout's tensor and pipeline peers of one
        data-parallel rank are fed the same samples, and only its data leader records them, under its
        data-parallel rank (training/mesh.py `is_data_leader`).
        """
        workload = workload_of(train)
        data = workload.train_split()
        par = train.parallel
        dp = data_parallel_degree(par, world_size)
        blend = workload.blend(data, train.run.seed)
        n = blend.epoch_size if blend else len(data)
        weights = tuple(source.weight for source in data.manifest.blend or ()) if blend else None
        counts = tuple(data.source_samples) if blend else None
        return cls(
            n, par.micro_batch, par.grad_accum_steps, dp, train.run.seed, train.data.drop_last, blend, weights, counts
        )

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch * self.grad_accum_steps * self.world_size

    @property
    def steps_per_epoch(self) -> int:
        """n // global_batch when dropping the remainder, the ceiling when padding the last batch."""
        whole, rest = divmod(self.n_samples, self.global_batch)
        return whole + int(rest > 0 and not self.drop_last)

    @property
    def remainder_size(self) -> int:
        """Indices an epoch leaves out (drop_last)."""
        return self.n_samples % self.global_batch if self.drop_last else 0

    @property
    def padding_size(self) -> int:
        """Indices an epoch hands out twice (no drop_last)."""
        return 0 if self.drop_last else -self.n_samples % self.global_batch

    def uninterrupted(self, rank: int, step: int) -> tuple[int, int, list[int]]:
        """(epoch, offset, indices) that `rank` is fed at `step` of a run that was never interrupted."""
        sampler = GlobalBatchSampler(
            self.n_samples, self.micro_batch, self.grad_accum_steps, self.world_size, rank, self.seed, self.drop_last
        )
        sampler.state = start = sampler.position(step - 1)
        epoch, micro = sampler.next_step()
        return epoch, start.offset, [int(i) for m in micro for i in m]


@dataclass
class _Replay:
    """One rank's records with each step once (its first attempt's record), and what the attempts showed."""

    steps: dict[int, dict[str, Any]]
    attempts: int
    resumed_from: list[int]
    steps_after_resume: set[int]


def _quote(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:_SHOWN])
    return shown + (f", ... ({len(values)} in all)" if len(values) > _SHOWN else "")


def _replay(rank: int, lines: list[dict[str, Any]], sampling: Sampling, problems: list[str]) -> _Replay:
    """Walk `rank`'s attempts in order: each begins after its checkpoint, continues the order, skips no step."""
    steps: dict[int, dict[str, Any]] = {}
    attempts, resumes, after_resume = 0, [], set()
    refed: dict[int | None, list[int]] = defaultdict(list)  # resumed_from -> steps fed otherwise than before
    previous: dict[str, Any] | None = None
    for rec in lines:
        step, resumed_from = rec["step"], rec.get("resumed_from")
        new_attempt = previous is None or resumed_from != previous.get("resumed_from") or step <= previous["step"]
        if new_attempt:
            attempts += 1
            first = (resumed_from or 0) + 1
            if step != first:
                begun = "a fresh start" if resumed_from is None else f"the resume from step {resumed_from}"
                problems.append(f"rank {rank}: {begun} began at step {step}, expected step {first}")
            if resumed_from is not None:
                resumes.append(resumed_from)
                epoch, offset, indices = sampling.uninterrupted(rank, step)
                if rec["indices"] != indices or rec["epoch"] != epoch or rec.get("offset", offset) != offset:
                    problems.append(
                        f"rank {rank}: step {step}, the first after the resume from step {resumed_from}, was fed "
                        f"epoch {rec['epoch']} offset {rec.get('offset')} samples [{_quote(rec['indices'])}]; the "
                        f"uninterrupted order gives epoch {epoch} offset {offset} [{_quote(indices)}]"
                    )
        elif step != previous["step"] + 1:
            problems.append(f"rank {rank}: step {step} follows step {previous['step']} (steps skipped)")
        if resumed_from is not None:
            after_resume.add(step)
        earlier = steps.get(step)
        if earlier is None:
            steps[step] = rec
        elif earlier["indices"] != rec["indices"] or earlier["epoch"] != rec["epoch"]:
            refed[resumed_from].append(step)
        previous = rec
    for resumed_from, again in refed.items():
        problems.append(
            f"rank {rank}: steps {_quote(again)} were fed other samples when they ran again after the resume from "
            f"step {resumed_from}: the samples after a resume must continue the pre-resume order"
        )
    return _Replay(steps, attempts, resumes, after_resume)


def _epoch_ends(ends: list[EpochEnd], problems: list[str]) -> dict[int, EpochEnd]:
    """epoch -> its recorded end; an epoch that ended again after a resume must have ended the same way."""
    by_epoch: dict[int, EpochEnd] = {}
    for end in ends:
        earlier = by_epoch.setdefault(end.epoch, end)
        if earlier != end:
            problems.append(f"epoch {end.epoch} ended differently in two attempts: {earlier} and {end}")
    return by_epoch


def _check_epoch(
    epoch: int,
    by_rank: dict[int, list[list[int]]],
    steps: int,
    end: EpochEnd | None,
    ended: bool,
    sampling: Sampling,
    problems: list[str],
) -> dict[str, Any]:
    """Steps, repeats, overlap between ranks and (for an ended epoch) coverage of one epoch; its summary."""
    n, expected_steps = sampling.n_samples, sampling.steps_per_epoch
    if steps != expected_steps and (ended or steps > expected_steps):
        problems.append(f"epoch {epoch} ran {steps} steps, expected {expected_steps}")
    counts: Counter[int] = Counter(i for batches in by_rank.values() for batch in batches for i in batch)
    outside = sorted(i for i in counts if not 0 <= i < n)
    if outside:
        problems.append(f"epoch {epoch}: sample indices outside the training split [0, {n}): {_quote(outside)}")
    padded = Counter(end.padded) if end is not None else Counter()
    sets = {rank: {i for batch in batches for i in batch} for rank, batches in by_rank.items()}
    ranks = sorted(sets)
    for a_pos, a in enumerate(ranks):
        for b in ranks[a_pos + 1 :]:
            overlap = (sets[a] & sets[b]) - set(padded)
            if overlap:
                problems.append(f"epoch {epoch}: ranks {a} and {b} share {len(overlap)} samples")
    repeated = sorted(i for i, c in counts.items() if c > 1 + padded[i])
    if repeated:
        problems.append(f"epoch {epoch}: samples seen more than once: {_quote(repeated)}")
    summary = {"steps": steps, "expected_steps": expected_steps, "ended": ended, "seen": len(counts)}
    if not ended:
        return summary
    if end is None:
        problems.append(f"epoch {epoch} ended without a record of its remainder or padding (the trainer's epoch end)")
        dropped: set[int] = set()
    else:
        dropped = set(end.dropped)
        summary |= {"dropped": len(end.dropped), "padded": len(end.padded)}
        for what, got, want in (
            ("remainder", end.dropped, sampling.remainder_size),
            ("padding", end.padded, sampling.padding_size),
        ):
            if len(got) != want or len(set(got)) != len(got):
                rule = (
                    f"n % global_batch = {n} % {sampling.global_batch}"
                    if what == "remainder"
                    else f"(-n) % global_batch = (-{n}) % {sampling.global_batch}"
                )
                problems.append(
                    f"epoch {epoch}: the recorded {what} has {len(got)} indices ({len(set(got))} distinct), "
                    f"expected {rule} = {want} (data.drop_last={sampling.drop_last})"
                )
        seen_dropped = sorted(dropped & set(counts))
        if seen_dropped:
            problems.append(f"epoch {epoch}: samples in the recorded remainder were seen too: {_quote(seen_dropped)}")
    missing = [i for i in range(n) if counts[i] == 0 and i not in dropped]
    if missing:
        problems.append(
            f"epoch {epoch}: {len(missing)} of the {n} training samples never seen and not in the recorded "
            f"remainder: samples {_quote(missing)}"
        )
    return summary


def check_data_consistency(output_dir: Path, sampling: Sampling) -> DimensionResult:
    """Per epoch: ranks disjoint, coverage of every training sample (minus the recorded remainder), exact steps;
    across resumes: each rank continues its pre-resume order, no step skipped or fed differently."""
    run = RunOutput(output_dir)
    records = run.all_sample_records()
    world = sampling.world_size
    problems: list[str] = []
    if sorted(records) != list(range(world)):
        problems.append(f"sample records of ranks {sorted(records)}, expected 0..{world - 1}")
    replays = {rank: _replay(rank, lines, sampling, problems) for rank, lines in records.items()}
    all_steps = sorted(set().union(*(r.steps for r in replays.values()))) if replays else []
    for rank, replay in replays.items():
        missing = sorted(set(range(1, all_steps[-1] + 1)) - set(replay.steps)) if all_steps else []
        if missing:
            problems.append(f"rank {rank}: steps missing from the sample records: {_quote(missing)}")
    step_epoch: dict[int, int] = {}
    by_epoch: dict[int, dict[int, list[list[int]]]] = defaultdict(lambda: defaultdict(list))
    for rank, replay in replays.items():
        for step, rec in replay.steps.items():
            if step_epoch.setdefault(step, rec["epoch"]) != rec["epoch"]:
                problems.append(f"step {step}: rank {rank} was in epoch {rec['epoch']}, another in {step_epoch[step]}")
            by_epoch[rec["epoch"]][rank].append(rec["indices"])
    steps_in: Counter[int] = Counter(step_epoch.values())
    ends = _epoch_ends(run.epochs(), problems)
    last_epoch = max(by_epoch, default=-1)
    epochs = {}
    for epoch in sorted(by_epoch):
        ended = epoch < last_epoch or epoch in ends
        epochs[epoch] = _check_epoch(
            epoch, by_epoch[epoch], steps_in[epoch], ends.get(epoch), ended, sampling, problems
        )
    sources = _check_sources(replays, ends, last_epoch, sampling, problems) if sampling.blend else None
    resumed = sorted({s for r in replays.values() for s in r.resumed_from})
    after = set().union(*(r.steps_after_resume for r in replays.values())) if replays else set()
    if not all_steps:
        problems.append("no sample records (is run.record_samples off?)")
    coverage = "every training sample once per epoch, " + (
        "minus the recorded remainder" if sampling.drop_last else "plus the recorded padding"
    )
    return DimensionResult(
        name="data_consistency",
        passed=not problems,
        measured={
            "epochs": epochs,
            "epochs_complete_checked": [e for e, s in epochs.items() if s["ended"]],
            "steps": [all_steps[0], all_steps[-1]] if all_steps else [],
            "n_samples": sampling.n_samples,
            "global_batch": sampling.global_batch,
            "attempts": {rank: r.attempts for rank, r in replays.items()},
            "resumed_from_steps": resumed,
            "epochs_after_resume": sorted({step_epoch[s] for s in after if s in step_epoch}),
            **({"sources": sources} if sources is not None else {}),
        },
        threshold={
            "overlap": 0,
            "coverage": coverage,
            "steps_per_epoch": sampling.steps_per_epoch,
            "remainder": sampling.remainder_size,
            "padding": sampling.padding_size,
        },
        evidence={"records": str(output_dir / SAMPLES_DIR), "epochs": str(output_dir / EPOCHS)},
        message="; ".join(problems[:_SHOWN])
        + (f" (+{len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""),
        look_first=_look_first(problems),
    )


def _check_sources(
    replays: dict[int, _Replay], ends: dict[int, EpochEnd], last_epoch: int, sampling: Sampling, problems: list[str]
) -> list[dict[str, Any]]:
    """A blend, per source: each draw fed a sample of its own source; no sample twice within one of the source's
    cycles (its pass over every sample), across ranks, steps and resumes; every cycle that the ended epochs
    complete covers all of the source's samples (counting the recorded remainder's draws); and every ended epoch
    gave each source its weight's share of draws: the weights and the sources' sizes are the manifest's, never the
    trainer's Blend (whose quotas are what is under test)."""
    blend, weights, counts = sampling.blend, sampling.weights, sampling.source_samples
    assert blend is not None and weights is not None and counts is not None
    n_sources = len(weights)
    shares = [w / sum(weights) for w in weights]
    first_sample = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    fed_from: dict[int, Counter[int]] = defaultdict(Counter)  # epoch -> source of the sample fed -> draws
    seen: dict[tuple[int, int], Counter[int]] = defaultdict(Counter)  # (source, cycle) -> sample -> count
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)  # epoch -> source -> draws
    wrong: list[int] = []

    def take(epoch: int, draws: list[int], samples: list[int]) -> None:
        d = np.asarray(draws, dtype=np.int64)
        source = blend.source_of(d)
        position = epoch * np.asarray(blend.quota)[source] + d - blend.block[source]
        cycle = position // np.asarray(blend.source_samples)[source]
        local = np.asarray(samples, dtype=np.int64) - blend.offsets[source]
        for s, c, x in zip(source.tolist(), cycle.tolist(), local.tolist(), strict=True):
            seen[(s, c)][x] += 1
            per_epoch[epoch][s] += 1
        fed_from[epoch].update(
            (np.searchsorted(first_sample, np.asarray(samples, dtype=np.int64), side="right") - 1).tolist()
        )
        wrong.extend(int(x) for x in np.asarray(samples)[blend.source_of_sample(samples) != source])

    for rank, replay in replays.items():
        for step, rec in replay.steps.items():
            samples = rec.get("samples")
            if samples is None or len(samples) != len(rec["indices"]):
                problems.append(f"rank {rank}: step {step} has no resolved samples for its blend draws")
                continue
            take(rec["epoch"], rec["indices"], samples)
    for epoch, end in ends.items():
        if end.dropped:
            take(epoch, end.dropped, blend.samples(epoch, end.dropped).tolist())
    if wrong:
        problems.append(f"blend: samples fed from another source than their draw's: {_quote(sorted(wrong))}")
    ended = [e for e in per_epoch if e < last_epoch or e in ends]
    summary = []
    for s in range(n_sources):
        n, quota = blend.source_samples[s], blend.quota[s]
        twice = sorted({x for (src, c), counts in seen.items() if src == s for x, k in counts.items() if k > 1})
        if twice:
            problems.append(f"blend source {s}: samples drawn twice within one pass over the source: {_quote(twice)}")
        exact = shares[s] * sampling.n_samples  # rounding the shares to whole draws moves each by less than one
        off = [e for e in ended if abs(fed_from[e][s] - exact) >= 1]
        if off:
            problems.append(
                f"blend source {s}: epochs {_quote(off)} fed {[fed_from[e][s] for e in off[:_SHOWN]]} of its samples, "
                f"its weight {shares[s]:.4g} gives {exact:.4g} of {sampling.n_samples} draws per epoch (the "
                f"manifest's weights {list(weights)})"
            )
        done_positions = len(ended) * quota if ended == list(range(len(ended))) else 0
        complete = [c for (src, c) in seen if src == s and (c + 1) * n <= done_positions]
        for c in sorted(complete):
            missing = n - len(seen[(s, c)])
            if missing:
                problems.append(f"blend source {s}: its pass {c} over the source left {missing} of {n} samples out")
        observed = sum(fed_from[e][s] for e in ended)
        total = sum(sum(fed_from[e].values()) for e in ended)
        summary.append(
            {"source": s, "samples": counts[s], "weight": shares[s], "quota": quota,
             "observed_share": observed / total if total else None, "passes_complete": len(complete)}
        )  # fmt: skip
    return summary


def _look_first(problems: list[str]) -> str:
    text = " ".join(problems)
    if not problems:
        return ""
    if "resume" in text or "steps skipped" in text or "missing from the sample records" in text:
        return "the sampler position the checkpoint saves and restores (epoch, sample_offset), then the sample records"
    if "share" in text:
        return "the sampler's rank and seed on every rank, then the resume position"
    return "the sampler's epoch order and its last partial batch (data.drop_last) against the dataset's length"


def with_resumed_run(dimension: DimensionResult, resumed: DimensionResult) -> DimensionResult:
    """`dimension` with a resumed run's data consistency (the rank_kill drill's) folded in as measured['resume']."""
    problems = [f"resumed run: {resumed.message}"] if resumed.message else []
    if resumed.measured and not resumed.measured["resumed_from_steps"]:
        problems.append("resumed run: its sample records show no resume, so the resume order went unchecked")
    message = "; ".join(p for p in [dimension.message, *problems] if p)
    return DimensionResult(
        name=dimension.name,
        passed=dimension.passed and resumed.passed and not problems,
        measured={**(dimension.measured or {}), "resume": resumed.measured},
        threshold=dimension.threshold,
        evidence={**dimension.evidence, "resume": resumed.evidence},
        message=message,
        look_first=dimension.look_first or resumed.look_first or ("the rank_kill drill's run" if problems else ""),
    )
