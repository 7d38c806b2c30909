"""job.sbatch from untrusted specs: bad values are refused by the spec, and what gets through stays data.

The quoting is proven by running the rendered script with bash against stand-in Slurm tools
(`scontrol`, and an `srun` that starts its command once per node with that node's SLURMD_NODENAME)
and a stand-in Python that records the words and environment it was started with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.slurm import SlurmLauncher
from tasks.spec import SpecError

NODES = ["node-1", "node-2", "node-3"]
SCONTROL = "#!/bin/sh\nprintf '%s\\n' node-1 node-2 node-3\n"
# Starts the command once per node, as Slurm's srun does with one task per node.
SRUN = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in --*) shift ;; *) break ;; esac; done
for node in node-1 node-2 node-3; do SLURMD_NODENAME=$node "$@" || exit $?; done
"""
RECORDER = """#!{python}
import json, os, sys
# torchrun's log folder: --log-dir if given, else PET_LOG_DIR
log_dir = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--log-dir=")), os.environ.get("PET_LOG_DIR"))
record = {{"argv": sys.argv[1:], "log_dir": log_dir, "env": dict(os.environ)}}
with open(os.path.join(os.environ["RECORDS"], os.environ["SLURMD_NODENAME"] + ".json"), "w") as f:
    json.dump(record, f)
"""


@pytest.fixture
def fake_slurm(tmp_path: Path) -> dict[str, Path]:
    """A bin folder with scontrol, srun, apptainer (runs its command) and a recording python."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    tools = {
        "scontrol": SCONTROL,
        "srun": SRUN,
        "python": RECORDER.format(python=sys.executable),
        # apptainer exec [--nv] [--bind X]... IMAGE CMD...: record the binds, then run CMD
        "apptainer": '#!/bin/sh\nshift; [ "$1" = --nv ] && shift\n: > "$RECORDS/binds"\n'
        'while [ "$1" = --bind ]; do printf "%s\\n" "$2" >> "$RECORDS/binds"; shift 2; done\nshift; exec "$@"\n',
    }
    for name, text in tools.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {"bin": bin_dir, "records": records}


def run_script(script: str, fake: dict[str, Path], folder: Path) -> subprocess.CompletedProcess[str]:
    """Run job.sbatch with bash as the batch step would, on the stand-in tools."""
    path = folder / "job.sbatch"
    path.write_text(script)
    env = {
        "PATH": f"{fake['bin']}:/usr/bin:/bin",
        "RECORDS": str(fake["records"]),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node-[1-3]",
        "SLURMD_NODENAME": "node-1",  # the batch step runs on the first node
    }
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=60)


def records(fake: dict[str, Path]) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(fake["records"].glob("*.json"))}


def with_slurm(spec, **slurm):  # noqa: ANN001, ANN201 - a ClusterConfig with unvalidated slurm settings
    """The cluster with slurm fields set around the spec boundary (model_copy does not validate)."""
    return spec.cluster.model_copy(update={"slurm": spec.cluster.slurm.model_copy(update=slurm)})


def test_a_partition_with_shell_syntax_is_refused_by_the_spec_naming_field_value_and_fix(make_spec) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", "slurm": {"partition": "debug; touch /tmp/pwned"}}})
    assert (
        "cluster.slurm.partition=debug; touch /tmp/pwned: 'debug; touch /tmp/pwned' is not a Slurm name or "
        "comma-separated names; use letters, digits and _ . + - (gpu,cpu)"
    ) in caught.value.problems


BAD_SLURM = [
    ({"qos": "high\n"}, "cluster.slurm.qos="),
    ({"account": "ml$(id)"}, "cluster.slurm.account=ml$(id): 'ml$(id)' is not a Slurm name"),
    ({"python": "python3 -c 'import os'"}, "is not a plain program path"),
    ({"python": "/usr/bin/python3\n"}, "'/usr/bin/python3\\n' is not a plain program path"),
    ({"extra_args": ["--comment=$(id) x"]}, "cluster.slurm.extra_args.0=--comment=$(id) x: '--comment=$(id) x' is not"),
    ({"extra_args": ["--exclusive\ntouch /tmp/x"]}, "is not an sbatch option; write --option or --option=value"),
    ({"extra_args": ["touch"]}, "cluster.slurm.extra_args.0=touch: 'touch' is not an sbatch option"),
    ({"container_mounts": ["/data:/data,/etc:/etc"]}, "is not a SRC:DST[:FLAGS] mount of absolute paths"),
    ({"container_mounts": ["/a b:/c"]}, "cluster.slurm.container_mounts.0=/a b:/c: '/a b:/c' is not a SRC:DST"),
    ({"time_limit": "01:00:00\n"}, "'01:00:00\\n' is not a Slurm time"),
    ({"cpus_per_node": 10**30}, "cluster.slurm.cpus_per_node=1000000000000000000000000000000: must be <= 65536"),
    ({"mem_per_node_mb": 10**30}, "cluster.slurm.mem_per_node_mb=1000000000000000000000000000000: must be <="),
    ({"nice": 10**30}, "cluster.slurm.nice=1000000000000000000000000000000: must be <= 2147483645"),
]


@pytest.mark.parametrize(("slurm", "expected"), BAD_SLURM, ids=[e for _, e in BAD_SLURM])
def test_slurm_values_that_would_reach_the_script_unchecked_are_refused(make_spec, slurm, expected) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", "slurm": slurm}})
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


BAD_CLUSTER = [
    ({"env": {"A\n": "1"}}, "cluster.env=A\\n: 'A\\n' is not an environment variable name; use letters, digits"),
    ({"env": {"X;rm": "1"}}, "cluster.env=X;rm: 'X;rm' is not an environment variable name"),
    ({"env": {"1X": "1"}}, "'1X' is not an environment variable name"),
    ({"env": {"LD_PRELOAD": "/tmp/x.so"}}, "cluster.env=LD_PRELOAD: is reserved: it changes how the shell, the"),
    ({"env": {"BASH_ENV": "/tmp/x"}}, "cluster.env=BASH_ENV: is reserved"),
    ({"env": {"PATH": "/tmp"}}, "cluster.env=PATH: is reserved"),
    ({"env": {"PYTHONPATH": "/tmp"}}, "cluster.env=PYTHONPATH: is reserved"),
    ({"env": {"SLURM_NTASKS": "9"}}, "cluster.env=SLURM_NTASKS: is reserved"),
    ({"env": {"NCCL_DEBUG": "a\0b"}}, "cluster.env.NCCL_DEBUG=<value with NUL>: contains a NUL character"),
    ({"nodes": 10**30}, "cluster.nodes=1000000000000000000000000000000: must be <= 100000"),
    ({"procs_per_node": 10**30}, "cluster.procs_per_node=1000000000000000000000000000000: must be <= 256"),
    ({"max_restarts": 10**30}, "cluster.max_restarts=1000000000000000000000000000000: must be <= 100"),
]


@pytest.mark.parametrize(("cluster", "expected"), BAD_CLUSTER, ids=[e for _, e in BAD_CLUSTER])
def test_bad_env_names_reserved_variables_and_absurd_counts_are_refused(make_spec, cluster, expected) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", **cluster}})
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_each_node_writes_its_logs_into_its_own_folder(make_spec, fake_slurm, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 3, "procs_per_node": 1}})
    cluster = with_slurm(spec, python=str(fake_slurm["bin"] / "python"))
    script = SlurmLauncher().render(cluster, "/shared/run/run.json", "tiny", "/shared/run", None)
    done = run_script(script, fake_slurm, tmp_path)
    assert done.returncode == 0, done.stderr
    seen = records(fake_slurm)
    assert sorted(seen) == NODES
    assert {node: r["log_dir"] for node, r in seen.items()} == {n: f"/shared/run/logs/{n}" for n in NODES}
    endpoint = f"--rdzv-endpoint=node-1:{cluster.slurm.rdzv_port}"
    assert all(endpoint in r["argv"] and "--rdzv-id=4242" in r["argv"] for r in seen.values())


def test_shell_syntax_in_paths_env_values_and_mounts_is_passed_literally_and_never_run(
    make_spec, fake_slurm, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    payloads = [f"$(touch {marker})", f"`touch {marker}`", f"'; touch {marker}; '", f'"; touch {marker}; "']
    spec = make_spec(
        {"cluster": {"scheduler": "slurm", "nodes": 3, "procs_per_node": 1, "env": {"NCCL_DEBUG": " ".join(payloads)}}}
    )
    out = str(tmp_path / f"out {payloads[0]} {payloads[2]}")
    config_path = f"{out}/run.json"
    cases = {
        "bare": (with_slurm(spec, python=str(fake_slurm["bin"] / "python")), None),
        "apptainer": (
            with_slurm(
                spec, container="apptainer", container_mounts=[f"/data:/data{payloads[0]}", f"/x{payloads[3]}:/y"]
            ),
            f"img{payloads[1]}",
        ),
    }
    for name, (cluster, image) in cases.items():
        script = SlurmLauncher().render(cluster, config_path, "tiny", out, image)
        done = run_script(script, fake_slurm, tmp_path)  # in the container, `python` is the recorder too
        assert done.returncode == 0, (name, done.stderr)
        assert not marker.exists(), f"{name}: a spec value ran as shell code"
        for node, record in records(fake_slurm).items():
            assert record["argv"][-2:] == ["--config", config_path], (name, node)
            assert record["env"]["NCCL_DEBUG"] == " ".join(payloads)
    binds = (fake_slurm["records"] / "binds").read_text().splitlines()
    assert binds[1:] == [f"/data:/data{payloads[0]}", f"/x{payloads[3]}:/y"]


def test_a_python_path_with_shell_syntax_is_one_word_not_a_command(make_spec, fake_slurm, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    python = f"{fake_slurm['bin'] / 'python'}; touch {marker} #"
    done = run_script(
        SlurmLauncher().render(with_slurm(spec, python=python), "/r/run.json", "tiny", "/r", None), fake_slurm, tmp_path
    )
    assert done.returncode != 0 and f"exec: {python}: not found" in done.stderr, done.stderr
    assert not marker.exists()


def test_directives_with_shell_syntax_stay_comments_and_a_newline_is_refused(
    make_spec, fake_slurm, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    cluster = with_slurm(
        spec,
        python=str(fake_slurm["bin"] / "python"),
        partition=f"debug; touch {marker}",
        qos=f"$(touch {marker})",
        extra_args=[f"--comment=`touch {marker}`"],
    )
    script = SlurmLauncher().render(cluster, "/r/run.json", "tiny", "/r", None)
    assert f'#SBATCH "--partition=debug; touch {marker}"' in script.splitlines(), "quoted as sbatch reads it"
    done = run_script(script, fake_slurm, tmp_path)
    assert done.returncode == 0, done.stderr
    assert not marker.exists()
    with pytest.raises(UserError, match="has a control character"):
        SlurmLauncher().render(with_slurm(spec, partition=f"debug\ntouch {marker}"), "/r/run.json", "t", "/r", None)


def test_env_names_that_bypassed_the_spec_are_refused_when_rendering(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    cluster = spec.cluster.model_copy(update={"env": {"X=1; touch /tmp/x; Y": "1"}})
    with pytest.raises(UserError, match=r"are not variable names"):
        SlurmLauncher().render(cluster, "/r/run.json", "tiny", "/r", None)


def test_the_rendered_script_is_valid_bash(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "env": {"NCCL_DEBUG": "it's $(odd)\nmultiline"}}})
    path = tmp_path / "job.sbatch"
    path.write_text(SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None))
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True, env=dict(os.environ)).returncode == 0
