"""The recovery ladder against today's restart from storage: detection time, recovery time (RTO) and steps lost
(RPO) after a fault, for every rung, in one run on the same job; and the in-memory save's stall against a step.

Each rung's own drill (tasks/acceptance/drill_table.py: the same functions `tdeploy drill` runs) strikes a 2-node
job of the tiny model on the local launcher (acted-out nodes, one rank each, gloo; torchrun restarts
`--max-restarts`; a storage checkpoint every `--save-every` steps): today's restart from storage (rank_kill and
node_loss, the memory tier off), memory_restore (a node lost, restored from the peers' host-memory copies of every
step with storage moved aside), spare_takeover (a node lost, one hot spare joins the same job), replica_loss (a
replica group killed, healed live from the other) and hang (a rank stalls in a step; the watchdog finds it and
the job restarts). A node lost with no spare is recovered by a relaunch on the hosts left (node_loss,
memory_restore run without torchrun restarts: see Row.relaunch). Every drill reads its figures from the job's own
records (recovery.jsonl, hangs.jsonl, metrics), and compares the resumed run with one uninterrupted run shared by
all. RTO is from the fault to the first step trained after the recovery; "xtoday" is the RTO over rank_kill's;
"restore s" is the part of it the trainer spent restoring the state (recovery.jsonl), the rest is detection and
the start-up of the restarted processes.

The stall: four jobs of the same model with the memory tier off, on every 1 and every `--sparse-every` steps, and
at its default, `auto` (no storage saves, so auto's interval is unbounded). It is read from the step records: the
wall time between the end of a step and the end of the next less that step's own time, after a snapshot, against
the same gap in the job without copies (median of each); as a percentage of the median step. For auto, the
interval is the one its last decision chose (memory_tier.jsonl), the gaps are those after that decision, and the
tier's own figures (median stall per copy and step, from which it chose) are printed beside them.

Figures are wall times on a shared machine: other processes on its cores stretch them, so read them with the
machine's load in mind (printed beside the table), and use --repeats for a spread.

Usage: python benchmarks/recovery.py [--repeats 1] [--save-every 5] [--steps 12] [--stall-steps 60] [--keep DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drill_table import TABLE
from tasks.acceptance.drills import DrillContext, stopped_drill
from tasks.acceptance.ladder import memory_restore, spare_takeover
from tasks.acceptance.record import DrillResult
from tasks.acceptance.workspace import RunOutcome
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import DeploymentSpec, parse_spec
from training.checkpoint.memory_auto import TierDecision, tier_decisions
from training.recovery_record import recovery_events
from training.run_output import StepRecord
from training.storage import StorageConfig

RTO_GOAL_S = 10.0
STALL_GOAL = 0.05
"""The issue's goals: recovery in 10 s at most, the in-memory save holding training 5% of a step at most."""
MEMORY_EVERY_STEPS = memory_restore.MEMORY_EVERY_STEPS
"""The memory interval the drills run at: every step (checkpoint.memory_every_steps' default is auto, which starts
there and widens the interval where the stall exceeds STALL_GOAL of a step)."""


@dataclass(frozen=True)
class Row:
    """One drill of the table: the rung it drills and the most steps that rung may lose."""

    rung: str
    drill: str
    rpo_bound: int | None
    """Steps lost the rung promises at most (None: no promise judged)."""
    relaunch: bool = False
    """A node is lost with no spare: the job runs without torchrun restarts, and the drill's relaunch (on the
    hosts left, as a scheduler's requeue) is the recovery. With restarts the survivor would wait in the rendezvous
    for the lost node's agent, which nothing restarts on the local launcher."""


def rows(save_every: int) -> list[Row]:
    """The table's drills in ladder order, today's restart from storage first."""
    return [
        Row("storage (today)", "rank_kill", save_every),
        Row("storage (today)", "node_loss", save_every, relaunch=True),
        Row("1 live", "replica_loss", 0),
        Row("2 hot spare", "spare_takeover", spare_takeover.MEMORY_EVERY_STEPS),
        Row("3 memory", "memory_restore", MEMORY_EVERY_STEPS, relaunch=True),
        Row("hang -> restart", "hang", save_every),
    ]


def verdict(value: float | None, limit: float) -> str:
    """`met` when `value` is at most `limit`, `not met` above it, `-` when it was not measured."""
    if value is None:
        return "-"
    return "met" if value <= limit else "not met"


def snapshot_gaps(records: list[StepRecord], every: int | None, after_step: int = 0) -> list[float]:
    """Seconds between the end of each step and the end of the next, less the next step's own time: what the
    trainer did between the two. Only after a snapshot step (a step divisible by `every`) past `after_step`; every
    gap when `every` is None (no copies). Steps with no time recorded are passed over."""
    ended = {r.step: r for r in records if r.time_unix_s is not None and r.step_time_s is not None}
    gaps = []
    for step, record in sorted(ended.items()):
        after = ended.get(step + 1)
        if after is None or step <= after_step or (every is not None and step % every != 0):
            continue
        gaps.append(after.time_unix_s - record.time_unix_s - after.step_time_s)  # type: ignore[operator]
    return gaps


@dataclass(frozen=True)
class Stall:
    """The in-memory save's stall at one interval, from the step records of a job with copies and one without."""

    every: int
    snapshots: int
    step_s: float
    gap_s: float
    base_gap_s: float
    auto: TierDecision | None = None
    """memory_every_steps=auto: the tier's last decision (its interval is `every`), None for a fixed interval."""

    @property
    def stall_s(self) -> float:
        """Training held per snapshot: the gap after a snapshot over the gap with no copies (never below 0)."""
        return max(0.0, self.gap_s - self.base_gap_s)

    @property
    def share(self) -> float:
        """The stall per snapshot as a share of the median step."""
        return self.stall_s / self.step_s


def stall_of(
    every: int, with_copies: list[StepRecord], without: list[StepRecord], auto: TierDecision | None = None
) -> Stall:
    """The stall of copies every `every` steps: median gaps of both jobs, over the median step of the job without
    (auto: the gaps after its last decision, at the interval it chose)."""
    gaps = snapshot_gaps(with_copies, every, 0 if auto is None else auto.step)
    base = snapshot_gaps(without, None)
    steps = [r.step_time_s for r in without if r.step_time_s is not None]
    if not gaps or not base or not steps:
        raise ValueError(f"memory_every_steps={every}: too few timed steps to compare; raise --stall-steps")
    median = statistics.median
    return Stall(every, len(gaps), median(steps), median(gaps), median(base), auto)


def spec_for(work: Path, dataset: str, save_every: int, max_restarts: int, spares: int) -> dict[str, Any]:
    """The tiny model on 2 acted-out nodes of one rank each, a storage checkpoint every `save_every` steps."""
    return {
        "name": "bench-recovery",
        "cluster": {"scheduler": "local", "nodes": 2, "procs_per_node": 1, "accelerator": "cpu",
                    "max_restarts": max_restarts, "spares": spares},
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64, "vocab_size": 257,
                  "seq_len": 32},
        "parallel": {"sharding": "ddp", "micro_batch": 4, "grad_accum_steps": 1},
        "precision": {"dtype": "fp32"},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 2, "schedule": "cosine"},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(work / "ck"), "save_every_steps": save_every, "keep_last": 3,
                       "memory_dir": str(work / "shm")},
        "run": {"steps": 20, "seed": 7, "output_url": str(work / "out"), "log_every_steps": 5,
                "threads_per_rank": 1},
    }  # fmt: skip


def run_drill(spec: DeploymentSpec, root: Path, acceptance: AcceptanceConfig, name: str,
              reference: RunOutcome) -> tuple[DrillResult, float]:  # fmt: skip
    """Run drill `name` in a fresh folder `root` against the uninterrupted `reference`; its result and wall seconds."""
    ctx = DrillContext(spec.cluster, spec.training_config(), root, acceptance, reference=reference)
    started = time.monotonic()
    try:
        result = TABLE[name](ctx)
    except Exception as err:  # noqa: BLE001 - a drill that stops is a row of the table, the others still run
        result = stopped_drill(name, err)
    return result, time.monotonic() - started


def stall_jobs(spec: DeploymentSpec, root: Path, steps: int, sparse_every: int) -> list[Stall]:
    """Jobs without copies, with copies every 1 and every `sparse_every` steps and at auto, no storage saves; their
    stalls (auto's at the interval it chose last; left out when it decided the copies do not fit)."""
    ctx = DrillContext(spec.cluster, spec.training_config(), root, AcceptanceConfig(steps=steps, save_every_steps=5))
    records, decisions = {}, []
    for every in (0, 1, sparse_every, "auto"):
        name = f"stall-every-{every or 'off'}"
        checkpoint = {"save_every_steps": None, "save_at_end": False, "memory_every_steps": every}
        outcome = ctx.job(ctx.train(name, run={"steps": steps}, checkpoint=checkpoint), name).wait(600)
        if not outcome.ok:
            raise RuntimeError(f"{name}: the job {outcome.status.describe()}")
        records[every] = outcome.run.metric_records(0)
        if every == "auto":
            decisions = tier_decisions(str(outcome.output_dir))
    stalls = [stall_of(every, records[every], records[0]) for every in (1, sparse_every)]
    last = decisions[-1] if decisions else None
    if last is None or last.interval is None:
        print(f"  auto: the tier stayed off: {last.reason if last else 'no decision recorded'}", flush=True)
    else:
        stalls.append(stall_of(last.interval, records["auto"], records[0], last))
    return stalls


def restore_s(result: DrillResult) -> float | None:
    """Seconds the recovering start spent restoring the state, as the trainer recorded it (recovery.jsonl's
    restore_s of the last restore from a peer, memory or storage); None where the drill names no output folder."""
    out = result.evidence.get("output_dir")
    events = [] if out is None else [e for e in recovery_events(str(out)) if e.rung in ("live", "memory", "storage")]
    return events[-1].restore_s if events else None


def _num(value: float | None, width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{width}.{digits}f}"


def drill_table(results: list[tuple[Row, DrillResult, float]]) -> list[str]:
    """The drills' lines: figures, the ratio of RTO to today's restart (rank_kill), and each goal judged."""
    today = [r.recovery_s for row, r, _ in results if row.drill == "rank_kill" and r.recovery_s]
    base = statistics.median(today) if today else None
    lines = [
        f"{'rung':16} {'drill':15} {'passed':6} {'detect s':>8} {'restore s':>9} {'RTO s':>6} {'xtoday':>6} "
        f"{'lost':>4} {'wall s':>6}  {'RTO<=' + format(RTO_GOAL_S, 'g') + ' s':10} {'RPO bound':14}"
    ]
    for row, r, wall in results:
        ratio = None if base is None or r.recovery_s is None else r.recovery_s / base
        lost = "-" if r.steps_lost is None else str(r.steps_lost)
        bound = "-" if row.rpo_bound is None else f"<={row.rpo_bound}: {verdict(r.steps_lost, row.rpo_bound)}"
        lines.append(
            f"{row.rung:16} {row.drill:15} {str(r.passed):6} {_num(r.detection_s, 8)} {_num(restore_s(r), 9, 3)} "
            f"{_num(r.recovery_s, 6)} "
            f"{_num(ratio, 6)} {lost:>4} {wall:6.0f}  {verdict(r.recovery_s, RTO_GOAL_S):10} {bound:14}"
        )
    return lines


def stall_table(stalls: list[Stall]) -> list[str]:
    """The stall's lines: per interval, the median step, the gaps, the stall per snapshot and its goal."""
    lines = [
        f"{'memory_every':12} {'snapshots':>9} {'step ms':>8} {'gap ms':>7} {'gap off ms':>10} {'stall ms':>8} "
        f"{'stall/step':>10} {'per step':>8}  {'stall per step<=' + format(100 * STALL_GOAL, 'g') + '% of a step'}"
    ]
    for s in stalls:
        label = f"auto: {s.every}" if s.auto else str(s.every)
        lines.append(
            f"{label:>12} {s.snapshots:9d} {1e3 * s.step_s:8.1f} {1e3 * s.gap_s:7.2f} {1e3 * s.base_gap_s:10.2f} "
            f"{1e3 * s.stall_s:8.2f} {100 * s.share:9.1f}% {100 * s.share / s.every:7.1f}%  "
            f"{verdict(s.share / s.every, STALL_GOAL) if s.auto else '(not the default interval)'}"
        )
        if s.auto is not None and s.auto.stall_s is not None and s.auto.step_s is not None:
            lines.append(
                f"{'':12} the tier chose {s.every} at step {s.auto.step} from its own medians: stall "
                f"{1e3 * s.auto.stall_s:.2f} ms per copy, step {1e3 * s.auto.step_s:.1f} ms "
                f"({100 * s.auto.stall_s / s.auto.step_s:.1f}% of a step per copy)"
            )
    return lines


LADDER = ("replica_loss", "spare_takeover", "memory_restore")
"""The rungs that keep the state in memory: held to the RTO and RPO goals (the others are today's baseline)."""


def goals(results: list[tuple[Row, DrillResult, float]], stalls: list[Stall]) -> list[str]:
    """The issue's three goals, each judged over the ladder's drills (slowest RTO, most steps lost beyond the
    memory interval) and the stall at the default interval."""
    ladder = [(row, r) for row, r, _ in results if row.drill in LADDER]
    times = [r.recovery_s for _, r in ladder]
    worst_rto = None if not ladder or None in times else max(t for t in times if t is not None)
    losses = [r.steps_lost for _, r in ladder]
    beyond = None if not ladder or None in losses else max(
        (r.steps_lost or 0) - (row.rpo_bound or 0) for row, r in ladder)  # fmt: skip
    default = next((s for s in stalls if s.auto is not None), None)
    return [
        f"goal RTO <= {RTO_GOAL_S:g} s (ladder rungs, slowest): {_num(worst_rto, 0)} s -> "
        f"{verdict(worst_rto, RTO_GOAL_S)}",
        f"goal 0 steps lost beyond the memory interval (ladder rungs, most): "
        f"{'-' if beyond is None else max(0, beyond)} -> {verdict(beyond, 0)}",
        f"goal stall <= {100 * STALL_GOAL:g}% of a step at the default interval (memory_every_steps=auto"
        f"{'' if default is None else f' -> {default.every}'}), per step: "
        f"{'-' if default is None else f'{100 * default.share / default.every:.1f}%'} -> "
        f"{verdict(None if default is None else default.share / default.every, STALL_GOAL)}",
    ]


def main() -> None:
    """Run every rung's drill (--repeats times), then the stall jobs, and print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--save-every", type=int, default=5, help="storage checkpoint interval (steps)")
    parser.add_argument("--steps", type=int, default=12, help="steps of each drill job")
    parser.add_argument("--max-restarts", type=int, default=2)
    parser.add_argument("--stall-steps", type=int, default=60, help="steps of each stall job")
    parser.add_argument("--sparse-every", type=int, default=5, help="the second memory interval of the stall jobs")
    parser.add_argument("--only", nargs="*", choices=[row.drill for row in rows(1)], help="these drills only")
    parser.add_argument("--keep", type=Path, help="run in this folder and keep the jobs' records (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.monotonic()
    acceptance = AcceptanceConfig(steps=args.steps, save_every_steps=args.save_every, job_timeout_s=300)
    chosen = [row for row in rows(args.save_every) if args.only is None or row.drill in args.only]
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        work = args.keep or Path(tmp)
        dataset = prepare_dataset(
            PrepareConfig(output_url=str(work / "ds"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
                          tokenizer={"kind": "bytes"}, workers=1),
            StorageConfig(), validate=False,
        ).dataset_url  # fmt: skip
        plain = parse_spec(spec_for(work, dataset, args.save_every, args.max_restarts, 0), "bench-recovery")
        spared = parse_spec(spec_for(work, dataset, args.save_every, args.max_restarts, 1), "bench-recovery")
        relaunched = parse_spec(spec_for(work, dataset, args.save_every, 0, 0), "bench-recovery")
        load = os.getloadavg()[0]
        # One uninterrupted run of the same job, which every drill compares its resumed run with.
        reference = DrillContext(plain.cluster, plain.training_config(), work / "reference", acceptance).reference()
        results = []
        for repeat in range(args.repeats):
            for row in chosen:
                spec = spared if row.drill == "spare_takeover" else relaunched if row.relaunch else plain
                result, wall = run_drill(spec, work / f"{row.drill}-{repeat}", acceptance, row.drill, reference)
                results.append((row, result, wall))
                print(f"  {row.drill} #{repeat}: passed={result.passed} {result.message[:200]}", flush=True)
        stalls = stall_jobs(plain, work / "stall", args.stall_steps, args.sparse_every)
        print(f"\nrecovery after a fault, local launcher, 2 nodes x 1 rank (gloo, tiny model); storage save every "
              f"{args.save_every} steps, memory copy every {MEMORY_EVERY_STEPS}; max_restarts={args.max_restarts} "
              "(node_loss, memory_restore: 0 and a relaunch; spare_takeover: 1 spare); "
              f"{os.cpu_count()} cores, load {load:.1f} -> {os.getloadavg()[0]:.1f} "
              "(shared: wall times are noisy)")  # fmt: skip
        print("\n".join(drill_table(results)))
        print("\nin-memory save's stall (rank 0's step records; no storage saves):")
        print("\n".join(stall_table(stalls)))
        print()
        print("\n".join(goals(results, stalls)))
        print(f"\ntotal {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
