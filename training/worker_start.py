"""Workers forked from their torchrun agent, the payload already imported: no start-up of their own.

torchrun starts a `python -m training.train` worker as a new interpreter, which then spends seconds importing
torch, DCP and DTensor before it does anything (about 2.3 s of CPU on one core here; two ranks on two cores pay
it side by side, and again on every restart of the worker group). With WORKER_START_ENV set to "fork", the
agent imports the payload module once, before its workers start, and torchrun starts each worker with its own
`start_method="fork"` (a `MultiprocessContext`, as for a function entrypoint): the worker is a fork of the agent
and runs the module's `main(argv)` at once. Restarts fork again from the same untouched agent.

What a worker sees is kept as a worker of its own would see it:
- its own session and process group (torchrun's SubprocessHandler starts workers so; teardown kills by group);
- default signal dispositions, not the agent's handlers (torchrun's raise SignalException), before `main` runs;
- unbuffered stdout and stderr (`python -u`), its argv, and the payload's exit code (a non-zero code ends the
  process at once, as `training.process.exit_now` does; zero returns so torchrun collects it);
- a KeyboardInterrupt ends it by SIGINT, as an interpreter's does; Python's `random` is reseeded at fork.
- training.process knows the agent as its parent (die_with_parent compares the parent it was started by).

Only for payloads listed in FORKABLE (a module with `main(argv) -> int` that reads its environment when it
runs, not when imported) and where the launcher asked for it: the launchers set it for CPU jobs only. A GPU
job keeps a new interpreter per worker: the CUDA driver is not fork-safe once anything in the agent touched it,
which this machine cannot check.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

from training import process

WORKER_START_ENV = "TDEPLOY_WORKER_START"
"""'fork': the agent forks its workers with the payload imported; unset or 'exec': a new interpreter each."""
FORKABLE = ("training.train",)
"""Payload modules that may run in a forked worker (their `main(argv)` is the whole of `python -m module`)."""


_forked = False


def how_started() -> str:
    """'fork' in a worker forked from its agent (run_forked), 'exec' in one started as an interpreter of its own
    (recorded in ranks.json: `worker_start`)."""
    return "fork" if _forked else "exec"


def fork_requested(env: dict[str, str] | None = None) -> bool:
    """Whether this agent's launcher asked for forked workers."""
    return (os.environ if env is None else env).get(WORKER_START_ENV, "") == "fork"


def forkable_payload(cmd: object, cmd_args: list[str]) -> tuple[str, list[str]] | None:
    """The module and its arguments where torchrun would run `sys.executable -u -m MODULE ARGS` for a module in
    FORKABLE; None for anything else (a script, --no-python, another module): those start as before."""
    if cmd != sys.executable or len(cmd_args) < 3 or cmd_args[:2] != ["-u", "-m"]:
        return None
    module = cmd_args[2]
    return (module, list(cmd_args[3:])) if module in FORKABLE else None


def _default_signals() -> None:
    """Every signal the agent handles back to what a new interpreter starts with."""
    with contextlib.suppress(ValueError):  # not the main thread: nothing to undo there
        signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            current = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if sig == signal.SIGINT:
            wanted: Any = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            wanted = signal.SIG_IGN  # as Python itself sets them at start-up
        else:
            wanted = signal.SIG_DFL
        if callable(current) or current != wanted:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, wanted)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def run_forked(module: str, argv: list[str]) -> None:
    """The forked worker's entrypoint: `python -u -m MODULE ARGV` without starting an interpreter."""
    global _forked  # noqa: PLW0603 - this process is now a forked worker, for the rest of its life
    _forked = True
    os.setsid()
    _default_signals()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [module, *argv]
    try:
        code = importlib.import_module(module).main(argv)
    except KeyboardInterrupt:  # an interpreter dies of the SIGINT it did not handle
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        raise
    except Exception:  # the traceback in the worker's own output, as an interpreter prints it (torchrun's
        traceback.print_exc()  # process context only hands the first failure's to the agent)
        sys.stderr.flush()
        raise
    if code:
        process.exit_now(code)  # the payload's code as the worker's exit status; torchrun reads it as a failure's
    process.flush_output()  # a zero returns: torchrun collects the worker's return value


def fork_workers(launch_agent: Callable[..., Any]) -> Callable[..., Any]:
    """torchrun's `launch_agent` (torch.distributed.launcher.api), made to fork the workers of a FORKABLE payload:
    the payload module is imported here, in the agent, before the workers start; anything else starts as before."""

    def launch(config: Any, entrypoint: Any, args: list[Any], **kwargs: Any) -> Any:
        payload = forkable_payload(entrypoint, list(args))
        if payload is None:
            return launch_agent(config, entrypoint, args, **kwargs)
        module, argv = payload
        importlib.import_module(module)
        gc.collect()
        gc.freeze()  # the imported objects stay out of the workers' collections: fewer copied pages
        config.start_method = "fork"
        return launch_agent(config, run_forked, [module, argv], **kwargs)

    launch.tdeploy_forks = True  # type: ignore[attr-defined]
    return launch


def _error_written_ns(failure: Any) -> float:
    """When a failed worker wrote its error file (ns), or never (a worker killed by a signal writes none)."""
    try:
        return os.stat(failure.error_file).st_mtime_ns
    except (OSError, TypeError):
        return float("inf")


def every_failure(poll: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torchrun's MultiprocessContext._poll, reporting every worker that failed, the first to fail first.

    Its own poll reports the one failed worker that `join` happened to list first, and then closes the rest:
    when a crash on rank 1 makes rank 0's collective fail within the same instant, the job would be reported
    as failed on rank 0. torchrun's subprocess context reports them all and names the root cause by the time
    each wrote its error (whole seconds: ties go to the first listed); so here every failed worker is added
    once the rest are closed, ordered by when its error file was written."""

    def _poll(self: Any) -> Any:
        result = poll(self)
        if result is None or not result.failures or self._pc is None:
            return result
        from torch.distributed.elastic.multiprocessing.api import ProcessFailure  # noqa: PLC0415

        failures = dict(result.failures)
        for local_rank, proc in enumerate(self._pc.processes):
            if local_rank not in failures and proc.exitcode not in (None, 0):
                failures[local_rank] = ProcessFailure(
                    local_rank=local_rank, pid=proc.pid, exitcode=proc.exitcode, error_file=self.error_files[local_rank]
                )
        result.failures = dict(sorted(failures.items(), key=lambda item: _error_written_ns(item[1])))
        return result

    _poll.tdeploy_every_failure = True  # type: ignore[attr-defined]
    return _poll


def install() -> bool:
    """Fork this agent's workers from now on where its launcher asked for it (WORKER_START_ENV); whether it does."""
    if not fork_requested():
        return False
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext  # noqa: PLC0415
    from torch.distributed.launcher import api  # noqa: PLC0415 - the agent has it imported already

    if not getattr(api.launch_agent, "tdeploy_forks", False):
        api.launch_agent = fork_workers(api.launch_agent)
    if not getattr(MultiprocessContext._poll, "tdeploy_every_failure", False):
        MultiprocessContext._poll = every_failure(MultiprocessContext._poll)
    return True
