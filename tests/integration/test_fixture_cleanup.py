"""A server fixture whose setup or test times out stops its server right away, not at the end of the session."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.processes import run_group

pytestmark = pytest.mark.integration

# The inner session: the first test times out while the Prefect harness is still starting its server (2 s is
# far below a cold start); the second, which runs afterwards in the same session, records which of the
# server processes the harness started are still alive.
INNER = """\
import json
import os
from pathlib import Path

import pytest
from prefect.server.api.server import SubprocessASGIServer

from tests.conftest import process_running

RECORD = Path(os.environ["INNER_RECORD"])
start_server = SubprocessASGIServer._run_uvicorn_command


def start_recorded(server):
    proc = start_server(server)
    with RECORD.open("a") as record:
        record.write(f"{proc.pid}\\n")
    return proc


SubprocessASGIServer._run_uvicorn_command = start_recorded


@pytest.mark.timeout(2)
def test_times_out_while_its_server_starts(prefect_harness):
    pass


def test_records_the_servers_still_running():
    pids = [int(line) for line in RECORD.read_text().split()]
    RECORD.write_text(json.dumps({"started": pids, "running": [pid for pid in pids if process_running(pid)]}))
"""


@pytest.mark.timeout(300)
def test_a_fixture_that_times_out_in_setup_stops_its_server_before_the_next_test(tmp_path: Path) -> None:
    test_file = tmp_path / "test_inner.py"
    test_file.write_text(textwrap.dedent(INNER))
    record = tmp_path / "record.json"
    env = dict(os.environ, INNER_RECORD=str(record), PYTHONPATH=str(REPO))
    proc = run_group(
        [sys.executable, "-m", "pytest", "-q", "-n0", "-p", "no:cacheprovider", "-p", "tests.conftest", str(test_file)],
        timeout=240,
        cwd=REPO,
        env=env,
    )
    output = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "1 passed, 1 error" in proc.stdout, output  # the error: the fixture setup timed out
    assert "Timeout" in proc.stdout, output
    seen = json.loads(record.read_text())
    assert seen["started"], f"the harness started no server: {output}"
    assert seen["running"] == [], f"the harness's server outlived its timed-out fixture: {seen}\n{output}"
