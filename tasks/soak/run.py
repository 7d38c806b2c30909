"""The soak: one long job trained through the spec's launcher while failures arrive on a seeded schedule, each one
injected through the machinery the recovery drills use and judged from the records the job writes for that purpose.

- rank_kill: SIGKILL one rank (`Launcher.kill_rank`); torchrun restarts the workers, which restore from the
  host-memory copies (rung memory; storage without them).
- node_loss: SIGKILL the last node's agent and workers (`Launcher.kill_node`), its host memory wiped; the job ends
  (or, where the survivors wait in the rendezvous for the lost agent, is cancelled once it trained nothing for the
  hang timeout) and the soak submits it again as the launch step's requeue would (on
  `Launcher.relaunch_cluster`), restoring from the peers' host-memory copies.
- hang: SIGSTOP one rank (through `kill_rank`, which reaches its host): it stops progressing, the others block in
  its collective; the watchdog finds the hang after the soak's step timeout floor and torchrun's restart recovers.
- slow_node: one rank stopped and continued every half second for `slow_for_s` (it runs half of the time); the job
  must go on without a restart (no false hang).
- storage_outage: the job's checkpoints go to the soak's own S3 endpoint behind a TCP proxy
  (tasks/acceptance/outage.py) that is cut for `outage_s`; the saves fail loudly, training goes on, the next save
  after the outage commits.

Failures never overlap: one that comes due while the previous one is still recovering waits for it. The rung of a
restart is read from recovery.jsonl (training/recovery_record.py), the steps from the metrics, the saves from
checkpoints.jsonl; the goodput from validation.goodput; the memory of every process from psutil
(tasks/soak/memory.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import random
import shutil
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from tasks.acceptance.outage import TcpProxy
from tasks.acceptance.workspace import Job, first_step_time_after, last_step, variant
from tasks.errors import UserError
from tasks.launch import registry
from tasks.launch.base import Capabilities, JobState
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.soak.config import FailureKind, SoakConfig
from tasks.soak.memory import JobProcess, MemorySampler, job_processes, rank_step_times
from tasks.soak.result import NO_RESTART, REQUEUE, FailureOutcome, LossBand, SoakResult
from tasks.soak.schedule import Injection, failure_schedule
from training.checkpoint.memory import node_folder
from training.config import TrainConfig
from training.recovery_record import RecoveryEvent, recovery_events
from training.run_output import RunOutput, RunOutputFormatError
from training.watchdog import read_heartbeats
from validation.goodput import GoodputError, goodput_of_run

log = logging.getLogger(__name__)

JOB = "soak"
SOAK_STEPS = 10**7
"""The soak job's run.steps: more than it trains; the soak ends it (a preemption, else a cancel) when its time is up."""
PULSE_S = 0.5
"""A slow node's rank is stopped this long, then runs this long, again and again."""
SAVE_TIMEOUT_FACTOR = 3.0
"""The soak job's save timeout is this many times its step timeout floor (a save holds training for longer)."""
COLLECTIVE_BACKSTOP_S = 60
"""The soak job's collective timeout (cluster.network.collective_timeout_s, where the spec sets none): between the
watchdog's phases (the in-memory copy's exchange after a step) nothing else times a rank that stopped."""
RESTART_KINDS: frozenset[FailureKind] = frozenset({"rank_kill", "node_loss", "hang"})
BUCKET = "tdeploy-soak"


def left_out_kinds(
    cluster: ClusterConfig, capabilities: Capabilities, kinds: tuple[FailureKind, ...]
) -> dict[str, str]:
    """The failure kinds in `kinds` this cluster cannot take, each with why (asked of the launcher's capabilities)."""
    why: dict[str, str] = {}
    for kind in kinds:
        if kind == "node_loss" and (cluster.nodes < 2 or not capabilities.can_lose_node):
            why[kind] = ("needs cluster.nodes >= 2" if cluster.nodes < 2
                         else f"the {cluster.scheduler} launcher cannot lose one node of a running job")  # fmt: skip
        elif kind in ("hang", "slow_node") and (cluster.world_size < 2 or not capabilities.delivers_signals):
            why[kind] = ("needs 2+ ranks (peers that wait for the stopped one)" if cluster.world_size < 2
                         else f"the {cluster.scheduler} launcher cannot signal a rank")  # fmt: skip
        elif kind == "storage_outage" and not capabilities.runs_on_this_machine_only:
            why[kind] = (f"the {cluster.scheduler} launcher's ranks run off this machine and cannot reach the soak's "
                         "own S3 endpoint (127.0.0.1)")  # fmt: skip
    return why


def trained_step(output_dir: str) -> int:
    """The last step the job has trained: rank 0's metrics (written every few steps) or, ahead of them, the ranks'
    heartbeats (a rank in phase step N has trained N - 1; one saving or evaluating step N, N)."""
    beats = [b.step - (1 if b.phase in ("step", "startup") else 0) for b in read_heartbeats(output_dir).values()]
    return max([last_step(Path(output_dir)), *beats])


def soak_train(train: TrainConfig, root: Path, cfg: SoakConfig, s3_url: str | None) -> TrainConfig:
    """The soak job's config: `train` writing under root/soak, long enough, with the soak's recovery tiers and hang
    timeout; its checkpoints on the soak's S3 endpoint `s3_url` where a storage outage is drilled."""
    checkpoint: dict[str, Any] = {
        "save_every_steps": cfg.save_every_steps, "keep_last": 3, "memory_every_steps": cfg.memory_every_steps or 0,
    }  # fmt: skip
    sections: dict[str, Any] = {
        "run": {"steps": SOAK_STEPS, "stop_after_steps": None, "eval_every_steps": None},
        # A save is not timed by default (watchdog.save_timeout_s None): a rank that hangs in one would go unnoticed
        "watchdog": {"step_timeout_s": None, "step_timeout_floor_s": cfg.hang_timeout_s,
                     "save_timeout_s": SAVE_TIMEOUT_FACTOR * cfg.hang_timeout_s},
        "checkpoint": checkpoint,
    }
    if s3_url is not None:
        # A folder of its own per soak: the in-memory copies are keyed by the checkpoint URL (memory.job_key)
        folder = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]
        checkpoint.update({"url": f"s3://{BUCKET}/{folder}/checkpoints", "continue_on_save_failure": True,
                           "save_retries": 1, "save_retry_backoff_s": 0.5, "async_save": False})  # fmt: skip
        sections["storage"] = {"s3_endpoint_url": s3_url,
                               "options": {"config_kwargs": {"retries": {"max_attempts": 1}}}}  # fmt: skip
    return variant(train, root, JOB, **sections)


class _S3Endpoint:
    """The soak's own S3-compatible endpoint (moto) behind a TcpProxy that a storage outage cuts."""

    def __init__(self) -> None:
        import boto3
        from moto.server import ThreadedMotoServer

        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            os.environ.setdefault(key, "soak")
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        self.proxy = TcpProxy(*self.server.get_host_and_port())
        boto3.client("s3", endpoint_url=self.proxy.url, region_name="us-east-1").create_bucket(Bucket=BUCKET)

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()


class Soak:
    """One soak's state: the job (replaced by its requeue after a lost node), the clock, the outcomes so far."""

    def __init__(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        cfg: SoakConfig,
        root: Path,
        environment: JobEnvironment | None = None,
        image: str | None = None,
    ) -> None:
        self.cfg, self.root, self.image = cfg, root, image
        self.launcher = registry.launcher_class(cluster.scheduler)
        self.left_out = left_out_kinds(cluster, self.launcher.capabilities, cfg.kinds)
        kinds = tuple(k for k in cfg.kinds if k not in self.left_out)
        tail = min(cfg.mean_interval_s, cfg.duration_s / 5)  # a quiet end: the last failure's recovery is seen
        self.schedule = failure_schedule(cfg.duration_s, cfg.mean_interval_s, kinds, cfg.seed, tail)
        restarts = sum(1 for i in self.schedule if i.kind in RESTART_KINDS)
        network = cluster.network
        if network.collective_timeout_s is None:
            network = network.model_copy(update={"collective_timeout_s": COLLECTIVE_BACKSTOP_S})
        self.cluster = cluster.model_copy(
            update={"max_restarts": max(cluster.max_restarts, restarts + 1), "network": network}
        )
        self.environment = environment or JobEnvironment()
        if cfg.leak_mb_per_step is not None:
            self.environment = self.environment.with_drill_points(leak_memory={"mb_per_step": cfg.leak_mb_per_step})
        self.victims = random.Random(cfg.seed + 1)  # which rank each failure strikes: seeded too
        self.s3: _S3Endpoint | None = None
        self.train = train
        self.job: Job | None = None
        self.lost_host: str | None = None

    @property
    def out(self) -> RunOutput:
        """The soak job's run output (the same folder across its requeues)."""
        return RunOutput(self.train.run.output_url)

    def submit(self, cluster: ClusterConfig | None = None) -> Job:
        """Submit the soak job (again, after a lost node: on `cluster`)."""
        self.job = Job(cluster or self.cluster, self.train, JOB, self.environment, self.image, step="soak")
        return self.job

    def ranks(self) -> list[dict[str, Any]]:
        """The current attempt's ranks."""
        assert self.job is not None
        return self.job.ranks_record().ranks

    # --- the injections: each returns what it struck and the rungs expected to recover it ---

    def _restore_rung(self) -> tuple[str, ...]:
        # storage too with the copies on: the ladder takes a storage checkpoint newer than the newest copy (a failure
        # right after a save, before that step's copy); the steps lost are held to the memory interval either way
        return ("memory", "storage") if self.cfg.memory_every_steps else ("storage", "fresh")

    def inject(self, kind: FailureKind) -> tuple[str, tuple[str, ...]]:
        """Strike the job with `kind`; what was struck and the rungs expected to recover it."""
        assert self.job is not None
        ranks = self.ranks()
        if kind == "rank_kill":
            victim = self.victims.choice(ranks)
            self.job.launcher.kill_rank(self.job.handle, victim, signal.SIGKILL)
            return f"rank {victim['rank']} on {victim['host']}", self._restore_rung()
        if kind == "hang":
            victim = self.victims.choice(ranks)
            self.job.launcher.kill_rank(self.job.handle, victim, signal.SIGSTOP)
            return f"rank {victim['rank']} on {victim['host']} (stopped)", self._restore_rung()
        if kind == "node_loss":
            node = self.cluster.nodes - 1  # not node 0, whose agent serves the rendezvous store
            lost = self.job.kill_node(node, signal.SIGKILL)
            if self.cfg.memory_every_steps:
                shutil.rmtree(node_folder(self.train.checkpoint, node), ignore_errors=True)  # its host memory is gone
            self.lost_host = str(lost["host"])
            return f"node {node} ({lost['host']}, ranks {lost['ranks']})", self._restore_rung()
        if kind == "slow_node":
            victim = self.victims.choice(ranks)
            deadline = time.monotonic() + self.cfg.slow_for_s
            while time.monotonic() < deadline:
                self.job.launcher.kill_rank(self.job.handle, victim, signal.SIGSTOP)
                try:
                    time.sleep(PULSE_S)
                finally:  # never leave the rank stopped: that would be a hang, not a slow node
                    self.job.launcher.kill_rank(self.job.handle, victim, signal.SIGCONT)
                time.sleep(PULSE_S)
            return f"rank {victim['rank']} on {victim['host']} (half speed for {self.cfg.slow_for_s:.0f}s)", (
                NO_RESTART,
            )
        assert kind == "storage_outage" and self.s3 is not None
        at_step, t_down = trained_step(self.train.run.output_url), time.monotonic()
        self.s3.proxy.down()
        try:  # at least outage_s, and until a save has met the outage (a restart may be holding the first one back)
            time.sleep(self.cfg.outage_s)
            while time.monotonic() - t_down < self.cfg.recovery_timeout_s and not any(
                e.error is not None for e in self.out.checkpoints() if e.step > at_step
            ):
                time.sleep(0.2)
        finally:
            self.s3.proxy.up()
        return f"S3 endpoint cut for {time.monotonic() - t_down:.0f}s", (NO_RESTART,)

    # --- the recoveries, read from the job's records ---

    def await_restart(self, t_fail: float, at_step: int) -> dict[str, Any]:
        """Wait until the job restored after `t_fail` and trained the step after the restore (requeueing it, as the
        launch step would, if it ended); the recovery's figures, or its problem."""
        assert self.job is not None
        deadline = time.monotonic() + self.cfg.recovery_timeout_s
        requeued = False
        progress, progress_at = at_step, time.monotonic()
        while time.monotonic() < deadline:
            events: list[RecoveryEvent] = [e for e in recovery_events(self.train.run.output_url) if e.time >= t_fail]
            if events:
                event = events[0]
                restored = event.restored_step or 0
                first = first_step_time_after(Path(self.train.run.output_url), restored + 1, t_fail)
                if first is not None:
                    return {"rung": event.rung, "requeued": requeued, "restored_step": event.restored_step,
                            "steps_lost": max(0, at_step - restored),
                            "recovery_s": round(first - t_fail, 3)}  # fmt: skip
            status = self.job.status()
            now_step = trained_step(self.train.run.output_url)
            if now_step != progress:
                progress, progress_at = now_step, time.monotonic()
            if not status.state.terminal and self.lost_host is not None and not requeued:
                # The survivors wait in the rendezvous for the lost node's agent, which nothing restarts here: once
                # the job has trained nothing for the hang timeout, its allocation is given up (as Slurm ends a job
                # on a node failure) and the requeue below is the recovery.
                if time.monotonic() - progress_at > self.cfg.hang_timeout_s:
                    log.warning("soak job %s: no step since the node loss: cancelling it", self.job.handle.ref)
                    self.job.cancel()
                    status = self.job.status()
            if status.state.terminal:
                if requeued:
                    return {"requeued": True, "problem": f"the requeued job {status.describe()}"}
                lost = self.lost_host
                cluster = self.launcher.relaunch_cluster(self.cluster, lost) if lost else self.cluster
                log.warning("soak job %s %s: submitting it again", self.job.handle.ref, status.describe())
                self.submit(cluster)
                requeued = True
            time.sleep(0.2)
        return {"requeued": requeued, "problem": f"not recovered within {self.cfg.recovery_timeout_s:.0f}s"}

    def judge_absorbed(self, kind: FailureKind, t_fail: float, at_step: int) -> dict[str, Any]:
        """A slow node or a storage outage: the job went on without a restart; after an outage a save failed during
        it (loudly, in checkpoints.jsonl) and a later one committed."""
        assert self.job is not None
        deadline = time.monotonic() + self.cfg.recovery_timeout_s
        while time.monotonic() < deadline:
            restarts = [e for e in recovery_events(self.train.run.output_url) if e.time >= t_fail]
            if restarts or self.job.status().state.terminal:
                what = f"a restart (rung {restarts[0].rung})" if restarts else f"the job {self.job.status().describe()}"
                return {"problem": f"{kind} should be absorbed without a restart, but it caused {what}"}
            progressed = trained_step(self.train.run.output_url) > at_step
            if kind == "slow_node" and progressed:
                return {"rung": NO_RESTART, "steps_lost": 0}
            if kind == "storage_outage":
                events = [e for e in self.out.checkpoints() if e.step > at_step]
                failed = [e.step for e in events if e.error is not None]
                if failed and any(e.error is None and e.step > failed[0] for e in events):
                    return {"rung": NO_RESTART, "steps_lost": 0}
            time.sleep(0.2)
        return {"problem": f"the job made no progress past step {at_step} within {self.cfg.recovery_timeout_s:.0f}s"
                if kind == "slow_node" else "no save failed during the outage, or none committed after it"}  # fmt: skip

    def strike(self, planned: Injection, t0: float) -> FailureOutcome:
        """Inject one planned failure and judge its recovery."""
        at_step = trained_step(self.train.run.output_url)
        t_fail = time.time()
        self.lost_host = None
        try:
            target, expected = self.inject(planned.kind)
        except (UserError, ProcessLookupError, OSError) as err:
            return FailureOutcome(kind=planned.kind, planned_at_s=planned.at_s, injected_at_s=round(t_fail - t0, 3),
                                  target="?", at_step=at_step, expected=(), rung=None,
                                  problem=f"could not inject: {type(err).__name__}: {err}")  # fmt: skip
        if planned.kind in RESTART_KINDS:
            figures = self.await_restart(t_fail, at_step)
        else:
            figures = self.judge_absorbed(planned.kind, t_fail, at_step)
        if figures.get("requeued") and planned.kind != "node_loss" and not figures.get("problem"):
            figures["problem"] = f"the job ended and was requeued: {planned.kind} should be recovered inside the job"
        if figures.get("rung") and figures["rung"] not in expected and not figures.get("problem"):
            figures["problem"] = f"recovered by rung {figures['rung']}, expected {' or '.join(expected)}"
        bound = self.cfg.memory_every_steps
        if figures.get("rung") in ("memory", "storage") and bound and (figures.get("steps_lost") or 0) > bound:
            figures["problem"] = (f"{figures['steps_lost']} steps lost, more than the memory interval "
                                  f"(memory_every_steps={bound})")  # fmt: skip
        if figures.get("requeued") and figures.get("rung"):
            figures["rung"] = f"{REQUEUE}+{figures['rung']}" if planned.kind != "node_loss" else figures["rung"]
        outcome = FailureOutcome(kind=planned.kind, planned_at_s=planned.at_s, injected_at_s=round(t_fail - t0, 3),
                                 target=target, at_step=at_step, expected=expected, **figures)  # fmt: skip
        log.warning("soak: %s at %.0fs (%s, step %d): %s", planned.kind, outcome.injected_at_s, target, at_step,
                    outcome.problem or f"recovered by {outcome.rung}")  # fmt: skip
        return outcome

    def stop(self) -> None:
        """End the job: a preemption (it checkpoints and ends `preempted`) where the launcher delivers signals."""
        assert self.job is not None
        if self.job.status().state.terminal:
            return
        if self.launcher.capabilities.delivers_signals:
            self.job.launcher.signal(self.job.handle, signal.SIGTERM)
            deadline = time.monotonic() + self.cfg.recovery_timeout_s
            while time.monotonic() < deadline and not self.job.status().state.terminal:
                time.sleep(0.2)
        if not self.job.status().state.terminal:
            self.job.cancel()


def loss_band(out: RunOutput) -> LossBand:
    """Rank 0's losses over the soak (the latest attempt's value of each step)."""
    losses = [r.loss for _, r in sorted(out.metrics().items())]
    finite = [x for x in losses if math.isfinite(x)]
    return LossBand(
        first=losses[0] if losses else None, last=losses[-1] if losses else None,
        low=min(finite) if finite else None, high=max(finite) if finite else None,
        nonfinite_steps=len(losses) - len(finite),
    )  # fmt: skip


def run_soak(
    cluster: ClusterConfig,
    train: TrainConfig,
    cfg: SoakConfig,
    root: Path,
    environment: JobEnvironment | None = None,
    image: str | None = None,
) -> SoakResult:
    """Train `train` on `cluster` for cfg.hours under cfg's failure schedule; the soak's result (files not written)."""
    soak = Soak(cluster, train, cfg, root, environment, image)
    problems: list[str] = []
    outcomes: list[FailureOutcome] = []
    with ExitStack() as stack:
        if any(i.kind == "storage_outage" for i in soak.schedule):
            soak.s3 = _S3Endpoint()
            stack.callback(soak.s3.close)
        soak.train = soak_train(train, root, cfg, soak.s3.proxy.url if soak.s3 else None)
        job = soak.submit()
        sampler = stack.enter_context(MemorySampler(lambda: _processes(soak), cfg.sample_every_s))
        t0 = time.time()
        try:
            job.wait_until(lambda: last_step(job.output_dir) >= 1, "the soak job's first step", cfg.recovery_timeout_s)
            t0 = time.time()
            log.warning("soak: %d failures planned over %.0fs (%s)", len(soak.schedule), cfg.duration_s,
                        ", ".join(f"{i.kind}@{i.at_s:.0f}s" for i in soak.schedule) or "none")  # fmt: skip
            for planned in soak.schedule:
                time.sleep(max(0.0, t0 + planned.at_s - time.time()))
                outcomes.append(soak.strike(planned, t0))
                assert soak.job is not None
                if soak.job.status().state.terminal:
                    problems.append(f"the job ended after the {planned.kind} at {outcomes[-1].injected_at_s:.0f}s: "
                                    f"{soak.job.status().describe()}")  # fmt: skip
                    break
            time.sleep(max(0.0, t0 + cfg.duration_s - time.time()))
        finally:
            soak.stop()
        t_end = time.time()
    assert soak.job is not None
    final = soak.job.status()
    if final.state not in (JobState.PREEMPTED, JobState.CANCELLED, JobState.SUCCEEDED) and not problems:
        problems.append(f"the job {final.describe()} at the end of the soak")
    goodput = None
    try:
        goodput = goodput_of_run(soak.train.run.output_url, ended_unix_s=t_end)
    except (GoodputError, OSError, ValueError) as err:
        problems.append(f"goodput: {err}")
    processes = sampler.verdicts(rank_step_times(soak.out))
    band = loss_band(soak.out)
    problems += [f"{f.kind} at {f.injected_at_s:.0f}s: {f.problem or 'not recovered'}" for f in outcomes
                 if not f.recovered]  # fmt: skip
    problems += [f"memory leak: {p.describe()}" for p in processes if p.verdict == "leak"]
    if not any(p.verdict != "short" for p in processes):
        problems.append("no process of the job was sampled long enough to judge its memory")
    if band.nonfinite_steps:
        problems.append(f"{band.nonfinite_steps} steps with a non-finite loss")
    return SoakResult(
        passed=not problems, scheduler=cluster.scheduler, duration_s=round(t_end - t0, 3),
        mean_interval_s=cfg.mean_interval_s, seed=cfg.seed, memory_tier=cfg.memory_every_steps is not None,
        failures=outcomes, left_out=soak.left_out, steps_trained=last_step(Path(soak.train.run.output_url)),
        goodput=goodput, processes=processes, loss=band, problems=problems,
        output_dir=soak.train.run.output_url,
    )  # fmt: skip


def _processes(soak: Soak) -> dict[int, JobProcess]:
    """The soak job's processes on this machine, now (none before its ranks are recorded)."""
    try:
        ranks = soak.out.ranks()
    except RunOutputFormatError:  # read while the trainer rewrites it: the next sample reads it whole
        return {}
    return job_processes(ranks.ranks) if ranks is not None else {}
