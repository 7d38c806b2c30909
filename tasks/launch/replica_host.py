"""One host's replica group of an SSH job with fault_tolerance.mode=replica_groups (one group per host).

`python -m tasks.launch.replica_host --config run.json --job-id ID --group G --host ADDR --lighthouse-host ADDR0
--lighthouse-port PORT --procs-per-group P --max-restarts M --workdir DIR [--start-lighthouse] [--wait-for FILE ...]
--stop-file FILE [-- torchrun arguments]` takes the place of the host's torchrun agent in the SSH launcher's
command (tasks/launch/ssh.py), so that the wrapper's exit file, `tdeploy status`, `signal` and `cancel` work as for
any SSH job. It writes its own agent record (agents/node<G>.json: the process `signal` and `cancel` reach), then:

- on the first host (`--start-lighthouse`) it starts the torchft lighthouse bound to that host's inventory address
  (the rendezvous endpoint's, which the other hosts reach); elsewhere it waits until the lighthouse answers;
- it runs group G's torchrun through the agent (tasks/launch/lighthouse.py start_group: `replica-<G>` output and
  checkpoint folders), with `--local-addr` and the servers' address set to this host's inventory address, so that
  the other groups reach its store, manager and checkpoint server;
- it passes SIGTERM and SIGUSR1 on to the group (its workers checkpoint and exit PREEMPTED_EXIT_CODE);
- when the group ends it writes what the job's output needs, as the local supervisor does
  (tasks/launch/replica_supervisor.py): group 0's result.json, group 0's preemption record under the job's id, the
  group's failure.json for the restart policy;
- the first host keeps the lighthouse until every other group's exit file (`--wait-for`, written by the launcher's
  wrappers in the shared run folder) is there, or its own parent (sshd's session) is gone, or a short grace after
  the job's cancel marker (`--stop-file`) appeared: a group that ends first does not take the lighthouse away from
  the others, which finish the step they are in (their quorum needs it) and stop too.

The lighthouse's and the group agent's pids and start times go to `<workdir>/processes-<G>.json`, where the SSH
launcher's `cancel` finds them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from types import FrameType

from tasks.launch.agent import write_record
from tasks.launch.lighthouse import start_group, start_lighthouse, stop_sessions
from tasks.launch.replica_supervisor import FORWARDED_SIGNALS, copy_from_group, surface_failure, surface_preemption
from training.config import TrainConfig
from training.preemption import PREEMPTED_EXIT_CODE
from training.process import die_with_parent, exit_now, start_time
from training.run_output import RESULT

log = logging.getLogger("tasks.launch.replica_host")

LIGHTHOUSE_WAIT_S = 120.0
"""How long a group waits for the first host's lighthouse to answer before it gives up (exit 1)."""
CANCEL_GRACE_S = 10.0
"""How long the lighthouse stays for the other groups after the job was cancelled (beyond the heartbeat timeout)."""


def processes_file(workdir: Path, group: int) -> Path:
    """Where host-side process of group `group` records the lighthouse's and its agent's pid and start time."""
    return workdir / f"processes-{group}.json"


def url_host(host: str) -> str:
    """`host` as it goes into a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """Whether `host`:`port` accepts a TCP connection within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            time.sleep(0.2)
    return False


def group_end(cfg: TrainConfig, group: int, code: int, job_id: str, since_unix_s: float) -> int:
    """What group `group`'s end leaves in the job's output (see the module's doc); the code the host exits with."""
    if code == 0:
        if group == 0 and not copy_from_group(cfg, 0, RESULT):
            print("replica group 0 exited 0 but wrote no result.json", flush=True)  # noqa: T201
            return 1
        return 0
    if code == PREEMPTED_EXIT_CODE:
        if group == 0:
            surface_preemption(cfg, job_id, since_unix_s)
        return code
    surface_failure(cfg, group, since_unix_s)
    return code


def keep_lighthouse(cfg: TrainConfig, exit_files: list[Path], stop_file: Path, parent: int) -> None:
    """Return once every other group's exit file is there, this process's parent is gone, or the job was cancelled
    (the stop file) CANCEL_GRACE_S + the heartbeat timeout ago: a cancelled group stops at its next step boundary,
    and the others finish the step they are in only while the lighthouse can form their quorum without it."""
    grace_s = CANCEL_GRACE_S + cfg.fault_tolerance.heartbeat_timeout_s
    cancelled_at = None
    while not all(p.exists() for p in exit_files) and os.getppid() == parent:
        if cancelled_at is None and stop_file.exists():
            cancelled_at = time.monotonic()
        if cancelled_at is not None and time.monotonic() - cancelled_at > grace_s:
            return
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    """Run this host's replica group (and on the first host the lighthouse) to its end; the host's exit code."""
    die_with_parent()  # sshd's session: the ssh client's end (a cancelled or dead submitter) ends this
    parent = os.getppid()
    write_record()
    parser = argparse.ArgumentParser(description="transformer-deploy: one host's replica group of an SSH job")
    parser.add_argument("--config", required=True, help="the job's run.json")
    parser.add_argument("--job-id", required=True, help="the launcher's job id")
    parser.add_argument("--group", type=int, required=True, help="this host's replica group")
    parser.add_argument("--host", required=True, help="this host's address, which the other hosts reach")
    parser.add_argument("--lighthouse-host", required=True, help="the first host's address")
    parser.add_argument("--lighthouse-port", type=int, required=True)
    parser.add_argument("--start-lighthouse", action="store_true", help="start the lighthouse here")
    parser.add_argument("--procs-per-group", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, required=True)
    parser.add_argument("--workdir", required=True, help="shared: the groups' configs and logs, the records")
    parser.add_argument("--wait-for", action="append", default=[], help="another group's exit file")
    parser.add_argument("--stop-file", required=True, help="the job's cancel marker")
    parser.add_argument("torchrun_args", nargs="*", help="after --: more torchrun arguments for the group")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s replica-{args.group} %(levelname)s: %(message)s")
    cfg = TrainConfig.from_json_file(args.config)
    started = time.time()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    lighthouse_url = f"http://{url_host(args.lighthouse_host)}:{args.lighthouse_port}"
    lighthouse = None
    if args.start_lighthouse:
        lighthouse = start_lighthouse(cfg, workdir, args.lighthouse_port, args.lighthouse_host)
        log.info("lighthouse on %s (pid %d)", lighthouse_url, lighthouse.pid)
    if not wait_for_port(args.lighthouse_host, args.lighthouse_port, LIGHTHOUSE_WAIT_S):
        print(f"the lighthouse at {lighthouse_url} did not answer within {LIGHTHOUSE_WAIT_S:.0f} s: check that the "
              f"first host runs it (its log: {workdir / 'lighthouse.log'}) and that port {args.lighthouse_port} "
              "is open between the hosts (cluster.rdzv_port)", flush=True)  # fmt: skip  # noqa: T201
        if lighthouse is not None:
            stop_sessions([lighthouse])
        return 1
    torchrun = [f"--local-addr={args.host}", *args.torchrun_args]  # the group's store: reached by the other groups
    group = start_group(cfg, args.group, workdir, args.procs_per_group, args.max_restarts, lighthouse_url,
                        args.host, torchrun_args=torchrun)  # fmt: skip
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if group.poll() is None:
            os.kill(group.pid, FORWARDED_SIGNALS[signal.Signals(signum)])

    for signum in FORWARDED_SIGNALS:
        signal.signal(signum, forward)
    procs = [("lighthouse", lighthouse), (f"replica-{args.group}", group)]
    record = [{"role": role, "pid": p.pid, "start_time": start_time(p.pid)} for role, p in procs if p is not None]
    partial = processes_file(workdir, args.group).with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(processes_file(workdir, args.group))
    try:
        code = group.wait()
        if received:
            log.info("stopped on %s", ", ".join(signal.Signals(s).name for s in received))
        code = group_end(cfg, args.group, code, args.job_id, started)
        if code not in (0, PREEMPTED_EXIT_CODE):
            tail = (workdir / f"replica-{args.group}.log").read_text(errors="replace")[-3000:]
            print(f"replica group {args.group} exited {code}; the end of its log:\n{tail}", flush=True)  # noqa: T201
        if lighthouse is not None:
            keep_lighthouse(cfg, [Path(p) for p in args.wait_for], Path(args.stop_file), parent)
    finally:
        stop_sessions([p for _, p in procs if p is not None])
    return code


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
