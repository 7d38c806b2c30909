"""The torchrun agent of a local job: `python -m torch.distributed.run`, set to die with the wrapper that started it."""

from __future__ import annotations

import runpy

from training.process import die_with_parent


def main() -> None:
    """Run torchrun with this process's arguments once the parent-death signal is in place."""
    die_with_parent()  # the wrapper is single-threaded sh: its exit is the only thing that fires this
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
