"""Test-only payload bugs, applied to a job's ranks from test code: nothing in training/ switches them on.

A test asks for bugs with `injected(**fields)` (job.py; the fields of `TestFaults`, bugs.py), which returns
the job's `JobEnvironment`: this package's harness folder first on the ranks' import path and the bugs as JSON
in TDEPLOY_TEST_FAULTS. Python imports the harness's `sitecustomize` at start-up in every process of that job,
which patches the trainer (tests/faults/payload.py) the way each bug would be written. Only a job's first
attempt is patched: workers that torchrun restarts (TORCHELASTIC_RESTART_COUNT > 0) run clean, so a test can
watch the job recover by itself.
"""

from pathlib import Path

HARNESS = Path(__file__).parent / "harness"  # the folder a job gets first on its PYTHONPATH
ROOT = Path(__file__).resolve().parents[2]  # the repository, where the ranks import training/ and tests/ from
