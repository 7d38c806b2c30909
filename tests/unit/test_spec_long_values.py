"""A megabyte in a wrongly typed spec field is refused at the cost of a kilobyte.

Each case puts one long word (no spaces, the shape that made the URL-password redactor quadratic) into a field of
one type of examples/local.yaml and validates the spec the way `tdeploy validate-spec` does. Quadrupling the value
from 256 KiB to 1 MiB may multiply the CPU time by at most CPU_RATIO: a linear cost grows 4 times (less where the
spec's own validation dominates), a quadratic one 16 times. Both are measured in one child process, in CPU time,
not wall time, so that a busy machine moves both alike. The child runs under RLIMIT_CPU, so that a quadratic cost
(12 minutes of CPU per field before the fix) ends in SIGXCPU instead of a hang.
"""

from __future__ import annotations

import copy
import json
import resource
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import yaml

from tests.conftest import REPO

SMALL = 1 << 18
LARGE = 1 << 20
CPU_RATIO = 8
"""Between the 4 times of a linear cost and the 16 times of a quadratic one."""
LINE_MAX = 1000
"""Characters of one problem line: it shows at most 200 characters (escaped: up to 4 each) of the value."""
MEASURE_CPU_S = 0.05
CHILD_CPU_S = 60
"""The child's kill switch, far above the few seconds a linear run takes with imports."""
# One field of each type a spec has: (name, dotted path, the value with WORD standing for the long word).
CASES: list[tuple[str, str, Any]] = [
    ("pattern-string", "name", "WORD"),
    ("integer", "cluster.nodes", "WORD"),
    ("float", "optim.lr_peak", "WORD"),
    ("literal", "cluster.scheduler", "WORD"),
    ("boolean", "data.drop_last", "WORD"),
    ("storage-url", "checkpoint.url", "s3://WORD"),
    ("local-path", "deployment_dir", "WORD\n"),
    ("endpoint-url", "storage.s3_endpoint_url", "WORD"),
    ("section", "model", "WORD"),
    ("list-of-models", "data.prepare.sources", ["WORD"]),
    ("list-item", "data.prepare.sources", [{"url": "WORD", "format": "WORD"}]),
    ("env-value", "cluster.env", {"NCCL_DEBUG": "WORD\n"}),
    ("env-name", "cluster.env", {"WORD": "1"}),
]


def _with_word(value: Any, word: str) -> Any:
    if isinstance(value, str):
        return value.replace("WORD", word)
    if isinstance(value, list):
        return [_with_word(v, word) for v in value]
    if isinstance(value, dict):
        return {_with_word(k, word): _with_word(v, word) for k, v in value.items()}
    return value


def _spec(path: str, value: Any) -> dict[str, Any]:
    data = copy.deepcopy(yaml.safe_load((REPO / "examples" / "local.yaml").read_text()))
    *parents, last = path.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return data


def _cpu_s_and_problems(data: dict[str, Any]) -> tuple[float, list[str]]:
    """The CPU time of one validation of `data` (the mean of as many as fill MEASURE_CPU_S: the clock may tick
    coarser than one cheap validation), and the problems reported."""
    from tasks.spec import SpecError, parse_spec

    calls, problems = 0, []
    started = time.process_time()
    while calls < 2 or time.process_time() - started < MEASURE_CPU_S:
        try:
            parse_spec(data, "<fuzz>")
        except SpecError as err:
            problems = err.problems
        calls += 1
    return (time.process_time() - started) / calls, problems


def measure() -> None:
    """In the child: per case, the CPU time of the 256 KiB and the 1 MiB value and the 1 MiB case's problems."""
    _cpu_s_and_problems(_spec("name", "warm-up"))  # imports and pydantic's first-use costs out of the figures
    results = {}
    for name, path, value in CASES:
        small, _ = _cpu_s_and_problems(_spec(path, _with_word(value, "a" * SMALL)))
        large, problems = _cpu_s_and_problems(_spec(path, _with_word(value, "a" * LARGE)))
        results[name] = {"small_s": small, "large_s": large, "problems": problems}
    print(json.dumps(results))


def _limit_cpu() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CHILD_CPU_S, resource.RLIM_INFINITY))


@pytest.mark.timeout(300)
def test_a_megabyte_value_in_any_field_costs_cpu_time_linear_in_its_length() -> None:
    code = "from tests.unit.test_spec_long_values import measure; measure()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, preexec_fn=_limit_cpu, check=False
    )
    assert done.returncode != -signal.SIGXCPU, (
        f"validating 1 MiB values used more than {CHILD_CPU_S} s of CPU (a cost that grows faster than the value)"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for name, path, _ in CASES:
        found = results[name]
        problems = "\n".join(found["problems"])
        assert not problems or path in problems, f"{name}: {path} not named in {problems[:500]!r}"
        longest = max(map(len, found["problems"]), default=0)
        assert longest < LINE_MAX, f"{name}: a problem echoes the value whole ({longest} characters)"
        assert found["large_s"] < CPU_RATIO * found["small_s"], (
            f"{name}: 1 MiB took {found['large_s']:.4f} s of CPU, 256 KiB {found['small_s']:.4f} s: "
            f"more than {CPU_RATIO} times"
        )
