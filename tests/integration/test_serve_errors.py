"""Starting and stopping the serving engine without vLLM: a taken port, a missing serving environment, a server
that crashes or never answers, and `tdeploy serve` on a spec it must refuse; real processes, fake servers.

The one vLLM start of a test session belongs to the end-to-end test; here a small script stands in for the
serving environment's Python (TDEPLOY_SERVE_PYTHON) and plays vLLM's part.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.errors import UserError
from tasks.launch.torchrun import free_port
from tasks.serve import server as server_module
from tasks.serve.config import ServeConfig
from tasks.serve.server import SERVE_PYTHON_ENV, ServerStartFailed, ServerStartTimeout, serve_python, start_server
from tests.conftest import REPO, TINY_SPEC, deep_merge
from tests.processes import start_group, stop_group

pytestmark = pytest.mark.integration


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A folder that looks like an exported model to start_server (it only checks config.json)."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for the serving Python: runs `body` with the port vLLM was given as PORT."""
    script = tmp_path / "fake-python"
    prelude = f"#!{sys.executable}\nimport sys\nPORT = int(sys.argv[sys.argv.index('--port') + 1])\n"
    script.write_text(prelude + textwrap.dedent(body))
    script.chmod(0o755)
    return script


# Answers GET /health with 200 and keeps a child in its process group, as vLLM's engine processes are.
HEALTHY_SERVER = """
import http.server, subprocess
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("child", child.pid, flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", PORT), Health).serve_forever()
"""


def _members(pgid: int) -> list[int]:
    return server_module._group_members(pgid)


def test_a_taken_port_is_refused_before_any_process_starts(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[Any] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *args, **kwargs: started.append(args))
    monkeypatch.setenv(SERVE_PYTHON_ENV, sys.executable)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UserError) as caught:
            start_server(model_dir, ServeConfig(port=port), "tiny", 32, tmp_path / "vllm.log")
    assert str(caught.value).startswith(f"serve.port={port}: 127.0.0.1:{port} cannot be bound")
    assert "set serve.port to a free port" in str(caught.value)
    assert started == [] and not (tmp_path / "vllm.log").exists()


def test_a_missing_serving_environment_says_to_run_setup(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SERVE_PYTHON_ENV, str(tmp_path / "nope" / "python"))
    with pytest.raises(UserError) as caught:
        start_server(model_dir, ServeConfig(port=free_port()), "tiny", 32, tmp_path / "vllm.log")
    message = str(caught.value)
    assert f"{SERVE_PYTHON_ENV}={tmp_path / 'nope' / 'python'} does not exist" in message
    assert "run `bash .ci/setup` (it makes .venv-serve with vLLM)" in message

    monkeypatch.delenv(SERVE_PYTHON_ENV)
    monkeypatch.setattr(server_module, "REPO", tmp_path)
    with pytest.raises(UserError, match=r"serving environment's Python .*/\.venv-serve/bin/python does not exist"):
        serve_python()


def test_a_server_that_crashes_at_start_is_a_user_error_with_the_engines_first_error_and_the_log(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crash = """
    print("(Worker pid=11) ERROR 12-02 05:55:23 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU "
          "attention configuration: head_dim=16 isa=2 kv_cache_idx=0")
    print("RuntimeError: Engine core initialization failed. See root cause above.")
    sys.exit(1)
    """
    monkeypatch.setenv(SERVE_PYTHON_ENV, str(_fake_python(tmp_path, crash)))
    log_path = tmp_path / "logs" / "vllm.log"
    with pytest.raises(ServerStartFailed) as caught:
        start_server(model_dir, ServeConfig(port=free_port()), "tiny", 32, log_path)
    err = caught.value
    assert err.returncode == 1 and err.log_path == log_path
    assert "exited with 1 before it answered /health (RuntimeError: Unsupported CPU attention" in str(err)
    assert f"the last lines of {log_path}:" in str(err) and "Engine core initialization failed" in err.log_tail


def test_a_server_that_never_answers_is_stopped_with_its_whole_group(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    silent = """
    import subprocess, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[0] + ".pids", "w").write(f"{child.pid}")
    print("loading weights", flush=True)
    time.sleep(600)
    """
    fake = _fake_python(tmp_path, silent)
    monkeypatch.setenv(SERVE_PYTHON_ENV, str(fake))
    begun = time.monotonic()
    with pytest.raises(ServerStartTimeout) as caught:
        start_server(model_dir, ServeConfig(port=free_port(), startup_timeout_s=3), "tiny", 32, tmp_path / "vllm.log")
    assert time.monotonic() - begun < 30
    assert "within serve.startup_timeout_s=3; it was stopped" in str(caught.value)
    assert "loading weights" in caught.value.log_tail
    child = int(Path(f"{fake}.pids").read_text())
    assert server_module.start_time(child) is None  # the engine-like child went with the server


def test_a_healthy_server_serves_until_stopped_and_stop_ends_every_process_of_its_group(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SERVE_PYTHON_ENV, str(_fake_python(tmp_path, HEALTHY_SERVER)))
    port = free_port()
    with start_server(model_dir, ServeConfig(port=port), "tiny", 32, tmp_path / "vllm.log") as server:
        assert server.url == f"http://127.0.0.1:{port}" and server.served_name == "tiny"
        assert server.alive() and server.health()
        members = _members(server.pid)
        assert server.pid in members and len(members) == 2  # the server and its child
    assert not server.alive() and not server.health()
    assert _members(server.pid) == []
    assert all(server_module.start_time(pid) is None for pid in members)


def _spec_file(tmp_path: Path, overrides: dict[str, Any]) -> Path:
    dataset = tmp_path / "dataset"
    dataset.mkdir(exist_ok=True)
    paths = {"deployment_dir": str(tmp_path / "deployment"), "data": {"dataset_url": str(dataset)}}
    data = deep_merge(TINY_SPEC, paths)
    for section, key in (("checkpoint", "url"), ("run", "output_url")):
        data[section].pop(key)
    data.update(overrides)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_tdeploy_serve_refuses_an_unservable_model_with_the_reason(tmp_path: Path) -> None:
    head_dim_16 = {"model": {**TINY_SPEC["model"], "d_model": 64, "n_heads": 4, "n_kv_heads": 2}, "serve": {}}
    result = CliRunner().invoke(app, ["serve", str(_spec_file(tmp_path, head_dim_16))])
    assert result.exit_code == 2, result.output
    assert "model.head_dim=16 (d_model=64 / n_heads=4): vLLM's CPU attention supports head_dim" in result.output
    assert "or set serve: null to train without serving" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "deployment" / "serving").exists()


def test_tdeploy_serve_refuses_a_spec_with_serving_off(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["serve", str(_spec_file(tmp_path, {"serve": None}))])
    assert result.exit_code == 2, result.output
    assert "the spec has no serve section: serving is off" in result.output


def test_tdeploy_serve_help_ends_with_an_example() -> None:
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "--model-dir" in result.output and "--step" in result.output
    assert result.output.rstrip().endswith("tdeploy serve examples/local.yaml --model-dir runs/local/export/step-20")


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_tdeploy_serve_stopped_by_a_signal_exits_128_plus_it_with_its_log_in_the_serving_folder(
    model_dir: Path, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    servable = {**TINY_SPEC["model"], "d_model": 64, "n_heads": 2, "n_kv_heads": 1}  # head_dim 32
    spec = _spec_file(tmp_path, {"model": servable, "serve": {"port": free_port()}})
    env = {**os.environ, SERVE_PYTHON_ENV: str(_fake_python(tmp_path, HEALTHY_SERVER))}
    out = tmp_path / "serve.out"
    command = [sys.executable, "-c", "from flows.cli import main; main()", "serve", str(spec), "--model-dir",
               str(model_dir)]  # fmt: skip
    with out.open("w") as sink:
        proc = start_group(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while "Ctrl-C stops it" not in out.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=60) == code, out.read_text()
    finally:
        stop_group(proc)
    assert "stopped the vLLM server (pid " in out.read_text() and f"on {sig.name}" in out.read_text()
    assert (tmp_path / "deployment" / "serving" / "server.log").is_file()  # where the serving check writes too
    assert not (tmp_path / "deployment" / "serve").exists()


# Answers /health; the first completion request kills the server (SIGKILL, as the kernel's OOM killer does).
DIES_ON_FIRST_REQUEST = """
import http.server, os, signal

class Dies(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        print("completion request: dying", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

http.server.HTTPServer(("127.0.0.1", PORT), Dies).serve_forever()
"""


def test_a_server_that_dies_during_the_check_is_named_with_its_exit_and_log_not_a_failed_request(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tasks.serve.check import HeldOut, ServingCheckConfig, measure
    from tasks.serve.server import ServerExited

    monkeypatch.setenv(SERVE_PYTHON_ENV, str(_fake_python(tmp_path, DIES_ON_FIRST_REQUEST)))
    log_path = tmp_path / "serving" / "server.log"
    data = HeldOut(prompts=[[1, 2, 3]] * 4, continuations=[[4, 5]] * 4, split="val")
    with start_server(model_dir, ServeConfig(port=free_port()), "tiny", 32, log_path) as server:
        with pytest.raises(ServerExited) as caught:
            measure(server, model_dir, data, [[0] * 8] * 4, [[0.0] * 2] * 4, ServingCheckConfig(), tmp_path / "serving")
    err = caught.value
    assert err.returncode == -9 and err.log_path == log_path and err.pid == server.pid
    assert str(err).startswith(
        f"the vLLM server (pid {server.pid}) exited with signal SIGKILL (-9) during the serving check"
    ), str(err)
    assert f"read {log_path}" in str(err) and "out-of-memory killer" in str(err)
    assert "completion request: dying" in err.log_tail
