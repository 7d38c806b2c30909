"""The restart policy: what happens after a job failed, decided from what the job left behind.

`decide` classifies the failure by a table of rules (`RULES`: cause -> class, what matched, fix) read top to
bottom by one loop, first match wins:

- workload (the trainer's failure.json, or a programming error or bad data in the root cause): stop, never retry;
  the fix is the trainer's own;
- infrastructure (a hang, a lost node, a lost rank, a rendezvous or network failure, storage): requeue, without the
  hosts the failure points at (rung 5 of the recovery ladder) where there are any;

then stops an infrastructure failure anyway when restarts make no progress (the job's last step did not advance
since the last failure) or the requeues (`recovery.requeues`) are used up. `remember` records the blamed hosts in
the deployment's node memory (tasks/recovery/quarantine.py) and adds every quarantined host to the exclusions.

The evidence is typed (`FailureEvidence`): the launch step builds it from the job's status and records, and the
same function decides for a recorded failure in the table tests.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tasks.hosts import HOST_NAME
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.quarantine import NodeMemory
from training.failure import WorkloadFailure
from training.health_gate import HEALTH_GATE_EXIT_CODE
from training.watchdog import HANG_EXIT_CODE

FailureClass = Literal["workload", "infrastructure"]
Action = Literal["stop", "requeue", "requeue_excluding"]

KILLED_AGENT_EXIT_CODES = frozenset({137, 255, -9})
"""An agent's exit that means its node went away: SIGKILLed (137 from its shell, -9 seen directly) or its SSH
connection lost (255)."""


@dataclass(frozen=True)
class FailureEvidence:
    """What a failed job left: its status, the trainer's and the watchdog's records, and how far it got."""

    job: str
    """The job's reference (scheduler:id)."""
    reason: str = ""
    """The launcher's reason (which agent exited how)."""
    exit_code: int | None = None
    """The job's exit code: the first failed agent's (torchrun), or the scheduler's."""
    failed_host: str | None = None
    """The host of the first agent that failed, where the launcher knows it."""
    rank_error: str = ""
    """The first failed rank's error (torchrun's root cause): 'killed by signal 9', a traceback's last line."""
    rank_exit_code: int | None = None
    """That rank's exit code (negative: killed by that signal)."""
    rank_host: str | None = None
    """That rank's host."""
    unreachable_hosts: tuple[str, ...] = ()
    """The job's hosts that did not answer after the failure (launchers that reach their hosts themselves)."""
    workload: WorkloadFailure | None = None
    """The trainer's failure.json of this job (a workload error it classified itself)."""
    hangs: tuple[str, ...] = ()
    """The watchdog's hang records of this job (hangs.jsonl), one line each."""
    hung_hosts: tuple[str, ...] = ()
    """The hosts of the ranks that did not arrive, per the hang records."""
    findings: tuple[str, ...] = ()
    """Causes the diagnosis (tasks/diagnose.py) named, where the caller ran it."""
    gate_excluded: tuple[str, ...] = ()
    """The hosts the job's health gate excluded (its health_gate.json), where the gate inside the allocation
    stopped the job (a Slurm batch script, training/health_gate.py)."""
    step_before: int | None = None
    """The last step trained when the previous failure of this job happened (None: the first failure)."""
    step_now: int | None = None
    """The last step trained now (None: unknown or none)."""
    requeues_done: int = 0
    """Requeues the launch step already made for this job."""

    @property
    def text(self) -> str:
        """The free text the rules' patterns search: the reason, the rank's error and the diagnosis's causes."""
        return "\n".join([self.reason, self.rank_error, *self.findings])


@dataclass(frozen=True)
class Rule:
    """One row of the policy: a cause, its class, what it matches in the evidence, the fix, whether it blames hosts."""

    cause: str
    failure_class: FailureClass
    matches: Callable[[FailureEvidence], list[str]]
    """The evidence lines that matched ([]: the rule does not apply)."""
    fix: str
    blames: Callable[[FailureEvidence], list[str]] = lambda e: []
    """The hosts the failure points at: excluded from the requeue and counted towards their quarantine."""


def _pattern(regex: str) -> Callable[[FailureEvidence], list[str]]:
    compiled = re.compile(regex, re.I)
    return lambda e: [line.strip()[:300] for line in e.text.splitlines() if compiled.search(line)][:5]


def _workload(cause: str) -> Callable[[FailureEvidence], list[str]]:
    return lambda e: [f"failure.json: {e.workload.describe()}"] if e.workload and e.workload.cause == cause else []


def _hosts(*hosts: str | None) -> list[str]:
    """The host names among `hosts` (a launcher's "host unknown" or an empty field blames nobody)."""
    return sorted({h for h in hosts if h and re.fullmatch(HOST_NAME, h)})


_BUG = r"^\s*(TypeError|AttributeError|NameError|UnboundLocalError|KeyError|IndexError|AssertionError|" \
       r"ZeroDivisionError|NotImplementedError|ImportError|ModuleNotFoundError|SyntaxError)\b"  # fmt: skip
_DATA = r"DatasetError|IndexFormatError"
_RENDEZVOUS = r"RendezvousTimeoutError|RendezvousConnectionError|rendezvous.*timed out|DistNetworkError|" \
              r"Name or service not known|failed to listen|Address already in use"  # fmt: skip
_STORAGE = r"CheckpointSaveError|StorageFailure|No space left|Read-only file system|Permission denied|" \
           r"EndpointConnectionError|checkpoint save to .* failed"  # fmt: skip
_NETWORK = r"Connection closed by peer|Connection reset by peer|Broken pipe|NCCL.*(error|timeout)|" \
           r"Watchdog caught collective operation timeout|Socket Timeout"  # fmt: skip


def _lost_node(e: FailureEvidence) -> list[str]:
    found = [f"host {h} does not answer" for h in e.unreachable_hosts]
    if e.exit_code in KILLED_AGENT_EXIT_CODES:
        found.append(f"the agent on {e.failed_host or 'a node'} ended with {e.exit_code} (killed, or its link lost)")
    if "without an exit status" in e.reason:
        found.append(e.reason.split(";")[0])
    return found


LOST_RANK_SIGNALS = frozenset({9, 7})
"""A rank ended by SIGKILL (the OOM killer, an operator, a dying host) or SIGBUS (a memory fault) was lost; one that
aborted or crashed on another signal (SIGABRT, SIGSEGV) may be the software's: it blames no host."""


def _rank_signal(e: FailureEvidence) -> int | None:
    if e.rank_exit_code is not None and e.rank_exit_code < 0:
        return -e.rank_exit_code
    found = re.match(r"killed by signal (\d+)", e.rank_error)
    return int(found.group(1)) if found else None


def _lost_rank(e: FailureEvidence) -> list[str]:
    signal = _rank_signal(e)
    if signal not in LOST_RANK_SIGNALS:
        return []
    return [f"rank on {e.rank_host or 'a host'} ended by signal {signal}: {e.rank_error}"]


def _crashed_rank(e: FailureEvidence) -> list[str]:
    signal = _rank_signal(e)
    return [] if signal is None else [f"rank on {e.rank_host or 'a host'} ended by signal {signal}: {e.rank_error}"]


def _hang(e: FailureEvidence) -> list[str]:
    found = list(e.hangs)
    if not found and e.rank_exit_code == HANG_EXIT_CODE:
        found.append(f"a rank exited with the watchdog's hang exit code {HANG_EXIT_CODE}")
    return found


def _gate(e: FailureEvidence) -> list[str]:
    found = [f"the health gate excluded {h}" for h in e.gate_excluded]
    if not found and e.exit_code == HEALTH_GATE_EXIT_CODE:
        found.append(f"the job exited with the health gate's exit code {HEALTH_GATE_EXIT_CODE}")
    return found


RULES: tuple[Rule, ...] = (
    Rule("nan_loss", "workload", _workload("nan_loss"),
         "the loss became NaN or infinite: lower optim.lr_peak or raise optim.warmup_steps, set optim.grad_clip_norm "
         "or train in bf16, then run again; a retry would meet the same NaN"),
    Rule("bad_data", "workload", lambda e: _workload("bad_data")(e) or _pattern(_DATA)(e),
         "the dataset is bad: fix it as the error says (prepare it again or point data.dataset_url at a good one), "
         "then run again"),
    Rule("bad_model", "workload", _workload("bad_model"),
         "the starting model (model.init_from) cannot be loaded or its logits differ from transformers': fix the "
         "spec's model section or the checkpoint as failure.json says, then run again"),
    Rule("bug", "workload", lambda e: _workload("bug")(e) or _pattern(_BUG)(e),
         "a programming error in the job: fix the code (the traceback is in the job's log), then run again"),
    Rule("health_gate", "infrastructure", _gate,
         "the health gate found nodes outside the band before the job started (health_gate.json in the run's "
         "output says why): the job is requeued without them; repair them, or set cluster.min_nodes so the job "
         "starts with the rest", blames=lambda e: _hosts(*e.gate_excluded)),
    Rule("hang", "infrastructure", _hang,
         "a rank stopped progressing: its stacks are in hangs/ of the run's output; the job is requeued without the "
         "hosts of the ranks that did not arrive", blames=lambda e: _hosts(*e.hung_hosts)),
    Rule("lost_node", "infrastructure", _lost_node,
         "a node went away (killed, rebooted or cut off): the job is requeued without it; check the host",
         blames=lambda e: _hosts(*e.unreachable_hosts, e.failed_host)),
    Rule("lost_rank", "infrastructure", _lost_rank,
         "a rank was killed (the kernel's OOM killer, an operator, a failing device): the job is requeued without "
         "its host; check the host's kernel log (dmesg) for the OOM killer or device errors",
         blames=lambda e: _hosts(e.rank_host)),
    Rule("rank_crash", "infrastructure", _crashed_rank,
         "a rank crashed on a signal (an abort or a segmentation fault, in native code): the job is requeued on the "
         "same hosts while it makes progress; the rank's log (and core dump) says where"),
    Rule("rendezvous_timeout", "infrastructure", _pattern(_RENDEZVOUS),
         "the ranks could not meet: open the rendezvous port between the nodes and make every node resolve every "
         "other's name (tdeploy check-nodes); the job is requeued"),
    Rule("storage", "infrastructure", _pattern(_STORAGE),
         "the storage failed (space, permissions, the object store's reachability): the job is requeued and "
         "resumes from the last committed checkpoint; check free space and credentials"),
    Rule("network", "infrastructure", _pattern(_NETWORK),
         "a peer's connection broke: the job is requeued without the host that failed first",
         blames=lambda e: _hosts(e.rank_host or e.failed_host)),
)
UNKNOWN = Rule("unknown", "infrastructure", lambda e: [e.reason or "no cause recorded"],
               "no known cause: the job is requeued while it makes progress; read its log")  # fmt: skip


class Decision(BaseModel):
    """What the policy decided after one failure of a job, and why (a line of decisions.jsonl)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    job: str = Field(description="The failed job (scheduler:id).")
    failure_class: FailureClass = Field(alias="class", description="workload or infrastructure.")
    cause: str = Field(description="The rule that matched (nan_loss, bad_data, bug, hang, lost_node, ...).")
    action: Action = Field(description="stop, requeue, or requeue_excluding the hosts in excluded_hosts.")
    why: str = Field(description="Why this action (the class, no progress, the requeues used up, ...).")
    fix: str = Field(description="What to do about the cause.")
    evidence: list[str] = Field(default_factory=list, description="What matched, from the job's records.")
    blamed_hosts: list[str] = Field(default_factory=list, description="The hosts the failure points at.")
    excluded_hosts: list[str] = Field(
        default_factory=list, description="Hosts the requeued job runs without (blamed and quarantined ones)."
    )
    quarantined_hosts: list[str] = Field(default_factory=list, description="Quarantined hosts after this failure.")
    step_before: int | None = Field(default=None, description="The last step at the previous failure.")
    step_now: int | None = Field(default=None, description="The last step at this failure.")
    requeue: int = Field(default=0, ge=0, description="Which requeue this decision starts (0: none).")
    time_unix_s: float = Field(default_factory=time.time, description="When it was decided.")

    def describe(self) -> str:
        """One line for people."""
        what = {"stop": "stop", "requeue": "requeue",
                "requeue_excluding": f"requeue without {', '.join(self.excluded_hosts)}"}[self.action]  # fmt: skip
        return f"{self.failure_class} failure ({self.cause}): {what}; {self.why}; fix: {self.fix}"


def classify(evidence: FailureEvidence) -> tuple[Rule, list[str]]:
    """The first rule of RULES that matches (UNKNOWN when none does) and what it matched."""
    for rule in RULES:
        matched = rule.matches(evidence)
        if matched:
            return rule, matched
    return UNKNOWN, UNKNOWN.matches(evidence)


def decide(evidence: FailureEvidence, config: RecoveryConfig) -> Decision:
    """The action after a failure: stop a workload error, stop when the last restart made no progress or the
    requeues are used up, else requeue (without the blamed hosts, where there are any)."""
    rule, matched = classify(evidence)
    blamed = rule.blames(evidence)
    before, now = evidence.step_before, evidence.step_now
    action: Action
    if rule.failure_class == "workload":
        action, why = "stop", "a workload error: running the job again cannot fix it (not retried)"
    elif before is not None and (now or 0) <= before:
        action = "stop"
        why = f"no progress since the last restart (step {now or 0} now, {before} at the previous failure)"
    elif evidence.requeues_done >= config.requeues:
        action = "stop"
        why = f"the requeues are used up ({evidence.requeues_done} of recovery.requeues={config.requeues})"
    else:
        action = "requeue_excluding" if blamed else "requeue"
        why = f"an infrastructure failure with progress (requeue {evidence.requeues_done + 1} of {config.requeues})"
    return Decision(
        job=evidence.job, failure_class=rule.failure_class, cause=rule.cause, action=action, why=why, fix=rule.fix,
        evidence=matched, blamed_hosts=blamed, excluded_hosts=blamed if action == "requeue_excluding" else [],
        step_before=before, step_now=now, requeue=evidence.requeues_done + 1 if action != "stop" else 0,
    )  # fmt: skip


def remember(decision: Decision, memory: NodeMemory) -> Decision:
    """Record the decision's blamed hosts in the node memory, and return it with every quarantined host excluded
    from a requeue (a requeue without exclusions becomes one without the quarantined hosts, where there are any)."""
    for host in decision.blamed_hosts:
        memory.record_failure(host, f"{decision.cause}: {'; '.join(decision.evidence)[:500]}", job=decision.job)
    quarantined = memory.quarantined()
    update: dict[str, object] = {"quarantined_hosts": quarantined}
    if decision.action != "stop":
        excluded = sorted({*decision.excluded_hosts, *quarantined})
        update |= {"excluded_hosts": excluded, "action": "requeue_excluding" if excluded else "requeue"}
    return decision.model_copy(update=update)
