"""Test harness: patch the payload in every process of a job started with this folder on PYTHONPATH.

Python imports `sitecustomize` at start-up, before the trainer's modules, so what it patches is what they use.
- TDEPLOY_TEST_FAULTS (tests/faults/job.py `injected`): the trainer bugs of tests/faults/payload.py, in a
  job's first attempt only.
- TDEPLOY_TEST_PATCH=module:function (tests/integration/parallel/model_parallel_faults.py `patched`): that one
  function is called.
The tests set these in one job's environment only, so the reference job beside it runs clean.
"""

import importlib
import os



def _install_faults() -> None:
    """The trainer bugs, in a job's first attempt only."""
    if os.environ.get("TDEPLOY_TEST_FAULTS") and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        from tests.faults.bugs import TestFaults
        from tests.faults.payload import install

        install(TestFaults.model_validate_json(os.environ["TDEPLOY_TEST_FAULTS"]))


if os.environ.get("TDEPLOY_TEST_FAULTS") and os.environ.get("TDEPLOY_WORKER_START") == "fork" and "RANK" not in os.environ:
    # An agent that forks its workers (training/worker_start.py): the bugs go into each forked worker as it
    # starts, where its attempt is known, and not into the agent, whose every fork would inherit them.
    from training import worker_start

    _run_forked = worker_start.run_forked

    def _run_forked_with_faults(module: str, argv: list) -> None:
        _install_faults()
        _run_forked(module, argv)

    worker_start.run_forked = _run_forked_with_faults
else:
    _install_faults()

_target = os.environ.get("TDEPLOY_TEST_PATCH")
if _target:
    _module, _, _function = _target.partition(":")
    getattr(importlib.import_module(_module), _function)()
