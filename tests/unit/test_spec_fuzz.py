"""A few hundred malformed specs through `tdeploy validate-spec`, `plan` and `train`'s pre-launch checks.

Each spec is examples/local.yaml with one thing broken: a huge, negative or mistyped count, an infinite or NaN
float, a control character or an unknown scheme in a URL, an unknown field, a credential nested in a free-form
section, an sbatch option or an environment name off the allow-lists, or a file that is no YAML mapping at all
(not UTF-8, an alias bomb, deep nesting, empty, a list).
Every command must refuse it in well under a second, without a traceback, with exit code 2 (a bad spec, as
`tdeploy` documents it) and with a message that names the offending field.
"""

from __future__ import annotations

import copy
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tests.conftest import REPO

BASE: dict[str, Any] = yaml.safe_load((REPO / "examples" / "local.yaml").read_text())
SECRET = "hunter2-fuzz"
BAD_SPEC_EXIT = 2

COUNTS = [
    "cluster.nodes",
    "cluster.procs_per_node",
    "model.n_layers",
    "model.d_model",
    "model.n_heads",
    "model.n_kv_heads",
    "model.ffn_hidden",
    "model.vocab_size",
    "model.seq_len",
    "parallel.micro_batch",
    "parallel.grad_accum_steps",
    "parallel.data_parallel",
    "run.steps",
    "run.log_every_steps",
    "run.eval_every_steps",
    "run.eval_batches",
    "run.threads_per_rank",
    "run.seed",
    "checkpoint.save_every_steps",
    "checkpoint.keep_last",
    "checkpoint.save_retries",
    "data.prepare.workers",
    "acceptance.steps",
    "acceptance.save_every_steps",
    "capacity.max_micro_batch",
    "capacity.search_top",
    "capacity.global_batch",
    "capacity.layout.tensor_parallel",
    "capacity.layout.pipeline_parallel",
]
BAD_COUNTS = {"huge": 10**30, "negative": -1, "word": "many", "fraction": 2.5, "list": [4]}
FLOATS = [
    "optim.lr_peak",
    "optim.lr_min",
    "optim.weight_decay",
    "optim.beta2",
    "optim.eps",
    "optim.grad_clip_norm",
    "model.norm_eps",
    "model.rope_theta",
    "model.init_std",
    "parallel.ddp_bucket_cap_mb",
    "checkpoint.save_retry_backoff_s",
    "capacity.mfu",
    "capacity.headroom_fraction",
    "acceptance.job_timeout_s",
    "acceptance.thresholds.scaling_efficiency_min",
]
BAD_FLOATS = {"inf": float("inf"), "minus-inf": float("-inf"), "nan": float("nan"), "word": "fast"}
URLS = [
    "checkpoint.url",
    "run.output_url",
    "capacity.output_url",
    "capacity.calibration_url",
    "acceptance.work_url",
    "data.prepare.output_url",
    "deployment_dir",
]
BAD_URLS = {
    "nul": "runs/a\x00b",
    "newline": "runs/a\nb",
    "escape": "runs/\x1b[2Ja",
    "ftp": "ftp://host/path",
    "javascript": "javascript://x",
    "no-scheme": "://nowhere",
    "empty": "",
    "list": ["runs/a"],
}
STRUCTURE: list[tuple[str, str, Any]] = [
    ("model-list", "model", [1, 2]),
    ("cluster-string", "cluster", "local"),
    ("parallel-number", "parallel", 5),
    ("run-null", "run", None),
    ("optim-bool", "optim", True),
    ("sharding-unknown", "parallel.sharding", "zero9"),
    ("scheduler-unknown", "cluster.scheduler", "pbs"),
    ("dtype-unknown", "precision.dtype", "fp8"),
    ("name-spaces", "name", "My Run"),
    ("name-nul", "name", "a\x00b"),
    ("name-empty", "name", ""),
    ("name-number", "name", 42),
    ("unknown-model-field", "model.n_layer", 2),
    ("unknown-run-field", "run.stepz", 10),
    ("unknown-storage-field", "storage.endpoint", "http://x"),
    ("unknown-checkpoint-field", "checkpoint.save_every", 10),
    ("endpoint-ftp", "storage.s3_endpoint_url", "ftp://127.0.0.1:9000"),
    ("endpoint-nul", "storage.s3_endpoint_url", "http://127.0.0.1:9000/\x00"),
    ("endpoint-password", "storage.s3_endpoint_url", f"http://minio:{SECRET}@127.0.0.1:9000"),
    ("output-on-s3", "run.output_url", "s3://bucket/output"),
    ("options-list", "storage.options", ["a"]),
]
# (name, where the secret goes, the field the message names: a credential-like key holding a mapping is one)
SECRETS: list[tuple[str, str, str]] = [
    ("storage-key", "storage.options.key", "storage.options.key=<redacted>"),
    ("storage-secret", "storage.options.secret", "storage.options.secret=<redacted>"),
    ("storage-token", "storage.options.token", "storage.options.token=<redacted>"),
    (
        "storage-client-kwargs",
        "storage.options.client_kwargs.aws_secret_access_key",
        "storage.options.client_kwargs.aws_secret_access_key=<redacted>",
    ),
    (
        "storage-deep",
        "storage.options.config_kwargs.s3.credentials.password",
        "storage.options.config_kwargs.s3.credentials=<redacted>",
    ),
    ("cluster-env", "cluster.env.AWS_SECRET_ACCESS_KEY", "cluster.env.AWS_SECRET_ACCESS_KEY=<redacted>"),
    ("cluster-env-hf", "cluster.env.HF_TOKEN", "cluster.env.HF_TOKEN=<redacted>"),
    ("image-env", "image.env.WANDB_API_KEY", "image.env.WANDB_API_KEY=<redacted>"),
    ("unknown-field", "run.api_key", "run.api_key=<redacted>"),
]
# sbatch options off the allow-list (the environment, working directory, identity or log path of the job) and
# environment names that make a library load code: refused at the spec, naming the field.
HOSTILE_SBATCH = [
    "--export=ALL,LD_PRELOAD=/x.so",
    "--export=ALL,BASH_ENV=/tmp/x",
    "--export=PATH=/tmp/evil",
    "--exp=ALL,LD_PRELOAD=/x.so",
    "--chdir=/etc",
    "--output=/etc/cron.d/x",
    "--error=/etc/cron.d/x",
    "--uid=0",
    "--gid=0",
    "--get-user-env",
    "-D=/etc",
    "--nodelist=/etc/hosts",
]
HOSTILE_ENV = [
    "NCCL_NET_PLUGIN",
    "NCCL_TUNER_PLUGIN",
    "NCCL_PROFILER_PLUGIN",
    "CUDA_INJECTION64_PATH",
    "GCONV_PATH",
    "GLIBC_TUNABLES",
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TORCH_EXTENSIONS_DIR",
    "LD_PRELOAD",
]
_LONG = "a" * (768 << 10)  # the spec file may hold 1 MiB
LONG_VALUES = [
    ("cluster.nodes", _LONG),
    ("run.seed", _LONG),
    ("optim.lr_peak", _LONG),
    ("name", _LONG),
    ("checkpoint.url", "s3://" + _LONG + ":x@"),
    ("storage.s3_endpoint_url", "http://" + "://" * (200 << 10)),
]
_ALIAS_BOMB = b"".join(
    [b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n']
    + [f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n".encode() for i in range(8)]
)
FILES: list[tuple[str, bytes, str]] = [
    ("latin-1", (REPO / "examples" / "local.yaml").read_bytes().replace(b"name: local", b"name: caf\xe9"), "UTF-8"),
    ("utf-16", (REPO / "examples" / "local.yaml").read_text().encode("utf-16"), "UTF-8"),
    ("binary", bytes(range(256)) * 4, "UTF-8"),
    ("truncated-utf8", b"name: \xe2\x82\n", "UTF-8"),
    ("alias-bomb", _ALIAS_BOMB, "aliases are not allowed"),
    ("merge-alias", b"base: &b {nodes: 1}\ncluster:\n  <<: *b\n", "aliases are not allowed"),
    ("deep-list", b"model: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nesting deeper than"),
    ("deep-map", b"".join(b"  " * i + b"k:\n" for i in range(200)) + b"  " * 200 + b"v\n", "nesting deeper than"),
    ("empty", b"", "the spec is empty"),
    ("comment-only", b"# nothing here\n", "the spec is empty"),
    ("list", b"- name: local\n", "must be a YAML mapping"),
    ("scalar", b"local\n", "must be a YAML mapping"),
    ("duplicate-key", b"name: a\nname: b\n", "appears twice"),
    ("too-large", b"name: local\n" + b"#" * (2 << 20) + b"\n", "is larger than"),
    ("raw-nul", b"name: lo\x00cal\n", "not valid YAML"),
    ("tab-indent", b"cluster:\n\tnodes: 1\n", "not valid YAML at line 2"),
    ("unclosed", b"model: [1, 2\n", "not valid YAML"),
    ("python-tag", b"name: !!python/object/apply:os.system ['true']\n", "not valid YAML"),
]


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(data)
    *parents, leaf = path.split(".")
    node = out
    for key in parents:
        if not isinstance(node.get(key), dict):
            node[key] = {}
        node = node[key]
    node[leaf] = value
    return out


def _cases() -> Iterator[Any]:
    for path in COUNTS:
        for kind, value in BAD_COUNTS.items():
            expected = f"- {path}={value}: must be <= " if kind == "huge" else f"- {path}="  # value and limit
            yield pytest.param(yaml.safe_dump(_set(BASE, path, value)).encode(), expected, id=f"{path}-{kind}")
    for path in FLOATS:
        for kind, value in BAD_FLOATS.items():
            yield pytest.param(yaml.safe_dump(_set(BASE, path, value)).encode(), f"- {path}=", id=f"{path}-{kind}")
    for path in URLS:
        for kind, value in BAD_URLS.items():
            yield pytest.param(yaml.safe_dump(_set(BASE, path, value)).encode(), f"- {path}=", id=f"{path}-{kind}")
    for name, path, value in STRUCTURE:
        yield pytest.param(yaml.safe_dump(_set(BASE, path, value)).encode(), f"- {path}=", id=name)
    for name, path, expected in SECRETS:
        yield pytest.param(yaml.safe_dump(_set(BASE, path, SECRET)).encode(), f"- {expected}", id=f"secret-{name}")
    for option in HOSTILE_SBATCH:
        spec = _set(BASE, "cluster.slurm.extra_args", ["--exclusive", option])
        expected = f"- cluster.slurm.extra_args.1={option}: "
        yield pytest.param(yaml.safe_dump(spec).encode(), expected, id=f"sbatch-{option}")
    for name in HOSTILE_ENV:
        spec = _set(BASE, f"cluster.env.{name}", "/shared/x.so")
        yield pytest.param(yaml.safe_dump(spec).encode(), f"- cluster.env={name}: ", id=f"env-{name}")
    for path, value in LONG_VALUES:  # a long word in a wrongly typed field: cut before it is redacted or shown
        yield pytest.param(yaml.safe_dump(_set(BASE, path, value)).encode(), f"- {path}=", id=f"long-{path}")
    for name, content, expected in FILES:
        yield pytest.param(content, expected, id=f"file-{name}")


CASES = list(_cases())


class _Hung(Exception):
    """A command ran past its time limit."""


def _invoke(args: list[str], cpu_budget_s: float = 10.0) -> Any:
    """The command under a CPU-time budget (ITIMER_PROF counts this process's user and system time, which a busy
    host does not inflate): a quadratic parser or redactor on a hostile value runs out of it; a wait would not."""

    def hung(signum: int, frame: object) -> None:
        raise _Hung(f"tdeploy {args[0]} still running after {cpu_budget_s} s of CPU time")

    previous = signal.signal(signal.SIGPROF, hung)
    signal.setitimer(signal.ITIMER_PROF, cpu_budget_s)
    try:
        return CliRunner().invoke(app, args)
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`train` may check but never prepare data or start processes; relative paths land in tmp_path."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a malformed spec got past train's pre-launch checks")

    monkeypatch.setattr("tasks.launch.local.run_local", refuse)
    monkeypatch.setattr("flows.cli.data.data_step", refuse)
    monkeypatch.chdir(tmp_path)


def test_the_fuzz_table_is_a_few_hundred_specs_that_all_differ_from_the_example() -> None:
    contents = [case.values[0] for case in CASES]
    assert len(CASES) >= 250 and len(set(contents)) == len(contents)
    assert yaml.safe_dump(BASE).encode() not in contents


@pytest.mark.usefixtures("no_launch")
@pytest.mark.parametrize(("content", "expected"), CASES)
def test_a_malformed_spec_is_refused_by_every_command_naming_what_is_wrong(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(content)
    for command in ("validate-spec", "plan", "train"):
        result = _invoke([command, str(spec)])
        assert not isinstance(result.exception, _Hung), result.exception
        assert "Traceback" not in result.output
        assert isinstance(result.exception, SystemExit) and result.exit_code == BAD_SPEC_EXIT, (
            command,
            result.exit_code,
            repr(result.exception),
            result.output[-2000:],
        )
        assert "invalid deployment spec" in result.output and expected in result.output, (command, result.output)
        assert SECRET not in result.output
