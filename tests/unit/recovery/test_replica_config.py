"""fault_tolerance: replica groups only for data-parallel layouts, with the fix named; the mode's environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.drills import DrillContext
from tasks.acceptance.ladder.replica_loss import drill_replica_loss
from tasks.acceptance.workspace import variant
from tasks.launch.cluster import ClusterConfig
from tasks.spec import SpecError
from training.config import FaultToleranceConfig, TrainConfig
from training.replica import REPLICA_GROUP_ENV, ReplicaGroupError, group_index, restarted


def _train(tmp_path: Path, parallel: dict[str, Any], fault_tolerance: dict[str, Any] | None = None) -> TrainConfig:
    raw: dict[str, Any] = {
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "ffn_hidden": 64, "vocab_size": 256, "seq_len": 16},
        "parallel": {"micro_batch": 2, **parallel},
        "optim": {"lr_peak": 1e-3}, "data": {"dataset_url": str(tmp_path)},
        "checkpoint": {"url": str(tmp_path / "c")}, "run": {"steps": 10, "output_url": str(tmp_path / "o")},
    }  # fmt: skip
    if fault_tolerance is not None:
        raw["fault_tolerance"] = fault_tolerance
    return TrainConfig.model_validate(raw)


def test_replica_groups_are_off_unless_asked_for(tmp_path: Path) -> None:
    assert _train(tmp_path, {}).fault_tolerance.mode == "none"


def test_a_ddp_layout_runs_as_replica_groups(tmp_path: Path) -> None:
    ft = _train(tmp_path, {"sharding": "ddp"}, {"mode": "replica_groups", "replica_groups": 3}).fault_tolerance
    assert (ft.mode, ft.replica_groups, ft.min_replicas) == ("replica_groups", 3, 1)


@pytest.mark.parametrize(
    ("parallel", "named"),
    [
        ({"sharding": "fsdp"}, "sharding=fsdp"),
        ({"sharding": "hsdp"}, "sharding=hsdp"),
        ({"sharding": "fsdp", "tensor_parallel": 2}, "tensor=2"),
        ({"sharding": "fsdp", "pipeline_parallel": 2, "grad_accum_steps": 2}, "pipeline=2"),
    ],
)
def test_a_sharded_or_model_parallel_layout_is_refused_with_the_fix(tmp_path: Path, parallel, named) -> None:
    with pytest.raises(ValidationError) as err:
        _train(tmp_path, parallel, {"mode": "replica_groups"})
    text = str(err.value)
    assert "fault_tolerance.mode" in text and named in text
    assert "use sharding=ddp" in text and "checkpoint.memory_every_steps" in text


def test_more_min_replicas_than_groups_is_refused() -> None:
    with pytest.raises(ValidationError, match="min_replicas=3 exceeds replica_groups=2; use at most 2"):
        FaultToleranceConfig(mode="replica_groups", min_replicas=3)
    with pytest.raises(ValidationError):
        FaultToleranceConfig(mode="replica_groups", replica_groups=1)


def test_the_group_index_comes_from_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPLICA_GROUP_ENV, "1")
    assert group_index(2) == 1
    for bad in ("2", "-1", "x", ""):
        monkeypatch.setenv(REPLICA_GROUP_ENV, bad)
        with pytest.raises(ReplicaGroupError, match=f"{REPLICA_GROUP_ENV}='{bad}'"):
            group_index(2)
    monkeypatch.delenv(REPLICA_GROUP_ENV)
    with pytest.raises(ReplicaGroupError, match="tasks/launch/lighthouse.py"):
        group_index(2)


def test_a_restart_is_torchruns_restart_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert not restarted()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restarted()


def test_the_trainer_imports_without_torchft() -> None:
    # torchft is an optional extra: the payload imports it only when replica groups are on
    code = (
        "import sys; sys.modules['torchft'] = None\n"
        "import training.train, training.replica\n"
        "assert 'torchft.manager' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_without_torchft_the_mode_names_the_extra_to_install() -> None:
    code = (
        "import sys, torch; sys.modules['torchft'] = None\n"
        "from training.config import FaultToleranceConfig\n"
        "from training.replica import ReplicaGroup, ReplicaGroupError\n"
        "from training.storage import StorageConfig\n"
        "try:\n"
        "    ReplicaGroup(FaultToleranceConfig(mode='replica_groups'), 0, torch.device('cpu'), dict, print, int,"
        " '/x', StorageConfig())\n"
        "except ReplicaGroupError as err:\n"
        "    print(err)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs torchft" in proc.stdout and "transformer-deploy[training]" in proc.stdout
    assert "fault_tolerance.mode=none" in proc.stdout


@pytest.mark.parametrize(
    ("cluster", "parallel", "why"),
    [
        ({"scheduler": "kubernetes"}, {}, "the kubernetes launcher does not run replica groups"),
        ({"scheduler": "local"}, {"sharding": "fsdp"}, "needs a data-parallel layout"),
    ],
)
def test_the_drill_is_skipped_where_replica_groups_cannot_run(tmp_path: Path, cluster, parallel, why) -> None:
    ctx = DrillContext(
        ClusterConfig(nodes=2, procs_per_node=1, accelerator="cpu", **cluster), _train(tmp_path, parallel),
        tmp_path / "drills", AcceptanceConfig(),
    )  # fmt: skip
    result = drill_replica_loss(ctx)
    assert result.passed is None and result.message.startswith("skipped: ") and why in result.message
    assert not (tmp_path / "drills" / "drill-replica-loss").exists()


def test_the_spec_section_reaches_the_trainer(make_spec) -> None:
    spec = make_spec({"fault_tolerance": {"quorum_timeout_s": 5.0, "heartbeat_timeout_s": 0.5}})
    ft = spec.training_config().fault_tolerance
    assert (ft.mode, ft.quorum_timeout_s, ft.heartbeat_timeout_s) == ("none", 5.0, 0.5)


def test_the_spec_refuses_replica_groups_where_the_launcher_cannot_run_them(make_spec) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"fault_tolerance": {"mode": "replica_groups"},
                   "cluster": {"scheduler": "kubernetes", "max_restarts": 1}})  # fmt: skip
    (problem,) = [p for p in caught.value.problems if p.startswith("fault_tolerance.mode")]
    assert problem.startswith("fault_tolerance.mode=replica_groups: cluster.scheduler=kubernetes cannot run replica")
    assert "use a scheduler that does (local, ssh, slurm), or set fault_tolerance.mode=none" in problem


def test_the_local_launcher_runs_them_when_the_groups_split_the_ranks_and_can_restart(make_spec) -> None:
    spec = make_spec({"fault_tolerance": {"mode": "replica_groups"}, "cluster": {"max_restarts": 1}})
    assert spec.training_config().fault_tolerance.replica_groups == 2
    with pytest.raises(SpecError) as caught:
        make_spec({"fault_tolerance": {"mode": "replica_groups", "replica_groups": 3}, "cluster": {"max_restarts": 1}})
    assert any(p.startswith("fault_tolerance.replica_groups=3: must divide cluster.nodes x cluster.procs_per_node = 2")
               and "use one of [2]" in p for p in caught.value.problems), caught.value.problems  # fmt: skip
    with pytest.raises(SpecError) as caught:  # the layout rule holds at the spec too
        make_spec({"fault_tolerance": {"mode": "replica_groups"}, "parallel": {"sharding": "fsdp"},
                   "cluster": {"max_restarts": 1}})  # fmt: skip
    assert any(p.startswith("fault_tolerance.mode=replica_groups: replica groups replicate the whole model")
               for p in caught.value.problems), caught.value.problems  # fmt: skip


@pytest.mark.parametrize(
    ("cluster", "problem"),
    [
        ({"max_restarts": 0}, "cluster.max_restarts=0: must be >= 1 with fault_tolerance.mode=replica_groups"),
        ({"max_restarts": 1, "spares": 1}, "cluster.spares=1: is not used with fault_tolerance.mode=replica_groups"),
        ({"max_restarts": 1, "nodes": 2, "procs_per_node": 1, "min_nodes": 1},
         "cluster.min_nodes=1: is not used with fault_tolerance.mode=replica_groups"),
    ],
)  # fmt: skip
def test_replica_groups_refuse_a_cluster_that_cannot_heal_them(make_spec, cluster, problem) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"fault_tolerance": {"mode": "replica_groups"}, "cluster": cluster})
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_acceptance_jobs_of_a_replica_groups_deployment_run_as_one_group_unless_the_drill_asks(tmp_path: Path) -> None:
    train = _train(tmp_path, {}, {"mode": "replica_groups", "replica_groups": 2, "heartbeat_timeout_s": 0.5})
    plain = variant(train, tmp_path / "drills", "drill-reference")
    assert plain.fault_tolerance.mode == "none" and plain.run.output_url == str(
        tmp_path / "drills/drill-reference/output"
    )
    drill = variant(train, tmp_path / "drills", "drill-replica-loss", fault_tolerance={"mode": "replica_groups"})
    assert (drill.fault_tolerance.mode, drill.fault_tolerance.heartbeat_timeout_s) == ("replica_groups", 0.5)
