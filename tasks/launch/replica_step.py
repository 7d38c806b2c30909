"""The end of a Slurm job's replica groups (fault_tolerance.mode=replica_groups): the job's outcome from its groups'.

The Slurm launcher's batch script runs one replica group per node in one srun step; each node's task records its
torchrun's exit code in `<workdir>/exit-<g>.txt` (tasks/launch/slurm.py). After the step the script runs
`python -m tasks.launch.replica_step --config run.json --job-id ID --workdir DIR --since UNIX_S`, which ends with
the job's exit code under the local launcher's rules (tasks/launch/replica_supervisor.py `outcome`): group 0's
result.json becomes the job's when every group exited 0; group 0's preemption record is written to the job's output
when every group stopped on the signal (the script then requeues as for any preempted job); otherwise a group's
failure.json is copied to the job's output and the failing group's code is the job's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.launch.replica_supervisor import outcome
from training.config import TrainConfig
from training.process import exit_now

EXIT_FILE = "exit-{group}.txt"
"""Under the workdir: the exit code of replica group `group`'s torchrun, written by its node's task."""
LOST_EXIT_CODE = 1
"""A group whose task wrote no exit code (its node or task was killed before it could)."""


def group_codes(workdir: Path, groups: int) -> list[int]:
    """Each group's exit code, as its task recorded it (LOST_EXIT_CODE where it recorded none)."""
    codes = []
    for group in range(groups):
        path = workdir / EXIT_FILE.format(group=group)
        text = path.read_text().strip() if path.exists() else ""
        codes.append(int(text) if text.isdigit() else LOST_EXIT_CODE)
    return codes


def main(argv: list[str] | None = None) -> int:
    """The job's exit code from its replica groups' (see the module's doc)."""
    parser = argparse.ArgumentParser(description="transformer-deploy: the outcome of a Slurm job's replica groups")
    parser.add_argument("--config", required=True, help="the job's run.json")
    parser.add_argument("--job-id", required=True, help="the Slurm job id")
    parser.add_argument("--workdir", required=True, help="the groups' configs and exit files")
    parser.add_argument("--since", type=float, required=True, help="when this run of the job began (Unix seconds)")
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_json_file(args.config)
    workdir = Path(args.workdir)
    codes = group_codes(workdir, cfg.fault_tolerance.replica_groups)

    def log_tail(group: int) -> str:
        return f"(above in this log; its torchrun's logs: {cfg.run.output_url}/logs/<the name of node {group}>)"

    return outcome(cfg, log_tail, codes, args.job_id, args.since)


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
