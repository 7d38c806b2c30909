"""The torchrun agent of a local job: `python -m torch.distributed.run`, set to die with the wrapper that started it."""

from __future__ import annotations

import runpy

from training.process import die_with_parent, exit_now


def main() -> int:
    """Run torchrun with this process's arguments once the parent-death signal is in place; its exit code."""
    die_with_parent()  # the wrapper is single-threaded sh: its exit is the only thing that fires this
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    except SystemExit as done:  # torchrun's own exit (a failed job: its code)
        code = done.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    exit_now(main())
