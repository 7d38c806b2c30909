"""A local job with replica groups (fault_tolerance.mode=replica_groups), as one process the local launcher runs.

`python -m tasks.launch.replica_supervisor --config run.json --job-id ID --procs-per-group P --max-restarts M
--workdir DIR [-- torchrun arguments]` takes the place of the job's torchrun agent under the local launcher's
wrapper, so that its exit file, `tdeploy status`, `tdeploy cancel` and the supervising process's watchdog work as
for any local job. It starts the torchft lighthouse and one torchrun per replica group (tasks/launch/lighthouse.py
ReplicaGroupsJob: `replica-<g>` output and checkpoint folders under the spec's), waits for every group, stops the
lighthouse and ends with the job's outcome:

- every group exited 0: group 0's result.json becomes the job's (the groups are replicas of one model); exit 0;
- a preemption signal (SIGTERM, SIGUSR1) is passed to each group's agent, whose workers checkpoint and stop; when
  every group ended so, group 0's preemption record is written to the job's output under the job's id, and the
  exit code is PREEMPTED_EXIT_CODE; SIGINT and SIGHUP stop the groups the same way (the cancel path);
- otherwise the first failing group's code; a group's failure.json (a workload error) is copied to the job's
  output, where the restart policy reads it, and the end of that group's log is printed to the job's log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from tasks.launch.lighthouse import ReplicaGroupsJob, group_config
from training import failure, preemption
from training.config import TrainConfig
from training.process import die_with_parent, exit_now
from training.run_output import RESULT
from training.storage import filesystem, join, write_bytes_atomic

log = logging.getLogger("tasks.launch.replica_supervisor")

PROCESSES_FILE = "processes.json"
"""Under --workdir: the lighthouse's and each group's agent's pid (written once they started)."""

FORWARDED_SIGNALS = {signal.SIGTERM: signal.SIGTERM, signal.SIGUSR1: signal.SIGUSR1,
                     signal.SIGINT: signal.SIGTERM, signal.SIGHUP: signal.SIGTERM}  # fmt: skip
"""What a signal to the process running replica groups becomes for their agents (SIGINT, SIGHUP: the cancel path)."""


def copy_from_group(cfg: TrainConfig, group: int, name: str) -> bool:
    """Copy `name` from replica group `group`'s output to the job's (atomically); False when the group has none."""
    fs, root = filesystem(cfg.run.output_url, cfg.storage)
    source = join(group_config(cfg, group).run.output_url, name)
    try:
        data = fs.cat_file(source)
    except FileNotFoundError:
        return False
    write_bytes_atomic(fs, join(root, name), data)
    return True


def surface_preemption(cfg: TrainConfig, job_id: str, since_unix_s: float) -> bool:
    """Write group 0's last preemption record since the job started to the job's output, under the job's id."""
    found = preemption.records_since(group_config(cfg, 0).run.output_url, since_unix_s, storage=cfg.storage)
    if not found:
        return False
    last = found[-1]
    preemption.append_record(cfg.run.output_url, dataclasses.replace(last, run_id=job_id), cfg.storage)
    return True


def surface_failure(cfg: TrainConfig, group: int, since_unix_s: float) -> bool:
    """Copy replica group `group`'s failure.json (a workload error written since the job started) to the job's
    output, where the restart policy reads it; False when the group wrote none."""
    if failure.failure_since(group_config(cfg, group).run.output_url, since_unix_s, cfg.storage) is None:
        return False
    return copy_from_group(cfg, group, failure.FAILURE_FILE)


def outcome(
    cfg: TrainConfig, log_tail: Callable[[int], str], codes: list[int], job_id: str, since_unix_s: float
) -> int:
    """The job's exit code from its groups' (see the module's doc), with what the job's output needs written;
    `log_tail(g)`: the end of group g's log, printed for a failed group (the Slurm launcher's replica_step too)."""
    if all(code == 0 for code in codes):
        if not copy_from_group(cfg, 0, RESULT):
            print("every replica group exited 0 but group 0 wrote no result.json", flush=True)  # noqa: T201
            return 1
        return 0
    if set(codes) <= {0, preemption.PREEMPTED_EXIT_CODE} and surface_preemption(cfg, job_id, since_unix_s):
        return preemption.PREEMPTED_EXIT_CODE
    failed = next(g for g, code in enumerate(codes) if code != 0)
    for group in range(len(codes)):
        if surface_failure(cfg, group, since_unix_s):
            failed = group
            break
    print(f"replica group {failed} exited {codes[failed]} (groups: {codes}); the end of its log:\n"
          f"{log_tail(failed)}", flush=True)  # fmt: skip  # noqa: T201
    return codes[failed]


def main(argv: list[str] | None = None) -> int:
    """Run the job's replica groups to their end; the job's exit code."""
    die_with_parent()  # the local launcher's wrapper: its exit (a SIGKILLed job) ends this, and the groups with it
    parser = argparse.ArgumentParser(description="transformer-deploy: a local job's replica groups")
    parser.add_argument("--config", required=True, help="the job's run.json")
    parser.add_argument("--job-id", required=True, help="the local launcher's job id")
    parser.add_argument("--procs-per-group", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--workdir", required=True, help="the groups' configs and logs, the lighthouse's log")
    parser.add_argument("torchrun_args", nargs="*", help="after --: more torchrun arguments for every group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s replicas %(levelname)s %(name)s: %(message)s")
    cfg = TrainConfig.from_json_file(args.config)
    started = time.time()
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        job.signal(FORWARDED_SIGNALS[signal.Signals(signum)])

    workdir = Path(args.workdir)
    job = ReplicaGroupsJob.start(cfg, workdir, args.procs_per_group, args.max_restarts,
                                 torchrun_args=args.torchrun_args)  # fmt: skip
    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    try:
        (workdir / PROCESSES_FILE).write_text(json.dumps(job.processes()))
        log.info("lighthouse and %d replica group(s) of %d rank(s) started; their logs: %s",
                 len(job.groups), args.procs_per_group, workdir)  # fmt: skip
        codes = [proc.wait() for proc in job.groups]
    finally:
        job.stop()
    if received:
        log.info("stopped on %s", ", ".join(signal.Signals(s).name for s in received))
    return outcome(cfg, job.log_tail, codes, args.job_id, started)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
