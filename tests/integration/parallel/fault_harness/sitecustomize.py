"""Test harness: apply one fault patch in every process of a job started with this folder on PYTHONPATH.

`TDEPLOY_TEST_PATCH=module:function` names the patch (tests/integration/parallel/model_parallel_faults.py); the
test sets both in that job's environment (cluster.env), so only that job's processes (torchrun's agent and its
workers) run the patched code, and the reference job beside it runs clean. Python imports `sitecustomize` at
start-up, before the trainer's modules, so a patched module attribute is what they import.
"""

import importlib
import os

_target = os.environ.get("TDEPLOY_TEST_PATCH")
if _target:
    _module, _, _function = _target.partition(":")
    getattr(importlib.import_module(_module), _function)()
