"""Acceptance on model-parallel layouts, on synthetic records: connectivity reads each rank's mesh coordinates and
sub-group collectives from ranks.json, performance judges stragglers within a pipeline stage and gradient sync
over the data-parallel ranks, the drills pick a rank inside a TP group and a data-parallel layout to reshard to."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tasks.acceptance.drills import kill_victim
from tasks.acceptance.workspace import data_parallel_layout, single_process
from tasks.launch.cluster import ClusterConfig
from training.config import TrainConfig
from training.layout import Layout
from training.run_output import Ranks, RunOutputWriter, StepRecord
from training.storage import StorageConfig
from validation.acceptance import AcceptanceThresholds, check_connectivity, check_performance, mesh_of
from validation.data_consistency import Sampling

# TP2 x DP2 (fsdp): mesh (pp, dp_replicate, dp_shard, cp, tp) = (1, 1, 2, 1, 2); tp is innermost.
TP2_DP2 = {"pp": 1, "dp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
TP_GROUPS = {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}
DP_GROUPS = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}


def _group(ranks: list[int]) -> dict[str, Any]:
    total = float(sum(r + 1 for r in ranks))
    return {"ranks": ranks, "all_reduce_sum": total, "all_reduce_expected": total}


def _tp2_dp2_ranks() -> list[dict[str, Any]]:
    """What the trainer records for TP2 x DP2, written out by hand (not by the rule under test)."""
    out = []
    for rank in range(4):
        dp_shard, tp = divmod(rank, 2)
        coords = {"pp": 0, "dp": dp_shard, "dp_replicate": 0, "dp_shard": dp_shard, "cp": 0, "tp": tp, "ep": 0}
        out.append({
            "rank": rank, "local_rank": rank, "host": "h", "backend": "gloo", "pid": 100 + rank,
            "resumed_from_step": None,
            "collective": {"all_reduce_sum": 10.0, "all_reduce_expected": 10.0, "broadcast_ok": True},
            "mesh": {"dims": TP2_DP2, "coords": coords,
                     "groups": {"tp": _group(TP_GROUPS[rank]), "dp": _group(DP_GROUPS[rank])}},
        })  # fmt: skip
    return out


def _connectivity(tmp_path: Path, ranks: list[dict[str, Any]]):  # noqa: ANN202
    RunOutputWriter(str(tmp_path), StorageConfig()).write_ranks(Ranks(len(ranks), ranks))
    return check_connectivity(tmp_path, 4)


def test_a_clean_tp2_dp2_mesh_passes_and_reports_every_ranks_coordinates(tmp_path: Path) -> None:
    result = _connectivity(tmp_path, _tp2_dp2_ranks())
    assert result.passed, result.message
    assert result.measured["mesh"] == {"dims": TP2_DP2, "groups_checked": {"dp": 4, "tp": 4}}
    assert result.evidence["coords"][3] == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 1, "ep": 0}


def test_a_wrong_sub_group_sum_fails_naming_the_rank_and_the_group(tmp_path: Path) -> None:
    ranks = _tp2_dp2_ranks()
    ranks[2]["mesh"]["groups"]["tp"]["all_reduce_sum"] = 4.0
    result = _connectivity(tmp_path, ranks)
    assert not result.passed
    assert "rank 2: the all-reduce over its tp group (ranks [2, 3]) gave 4.0, expected 7.0" in result.message
    assert result.look_first.startswith("the device mesh")


def test_two_ranks_at_one_mesh_place_fail(tmp_path: Path) -> None:
    ranks = _tp2_dp2_ranks()
    ranks[1]["mesh"]["coords"] = dict(ranks[0]["mesh"]["coords"])
    result = _connectivity(tmp_path, ranks)
    assert not result.passed and "ranks 0, 1 all claim the mesh place" in result.message


def test_a_group_whose_ranks_disagree_with_the_coordinates_fails(tmp_path: Path) -> None:
    ranks = _tp2_dp2_ranks()
    ranks[0]["mesh"]["groups"]["tp"] = _group([0, 2])  # a "tp" group across data-parallel ranks
    result = _connectivity(tmp_path, ranks)
    assert not result.passed
    assert "rank 0: its tp group is ranks [0, 2], its coordinates" in result.message and "put ranks [0, 1]" in (
        result.message
    )


def test_degrees_whose_product_is_not_the_world_and_a_missing_group_fail(tmp_path: Path) -> None:
    ranks = _tp2_dp2_ranks()
    for r in ranks:
        r["mesh"]["dims"] = {**TP2_DP2, "tp": 4}
    del ranks[3]["mesh"]["groups"]["dp"]
    result = _connectivity(tmp_path, ranks)
    assert "mesh pp1 x dp_replicate1 x dp_shard2 x cp1 x tp4 has 8 places for 4 ranks" in result.message
    assert "rank 3: no collective recorded on its dp group(s)" in result.message


def test_a_data_parallel_job_records_no_mesh_and_is_judged_as_before(tmp_path: Path) -> None:
    ranks = _tp2_dp2_ranks()
    for r in ranks:
        r.pop("mesh")
    result = _connectivity(tmp_path, ranks)
    assert result.passed and "mesh" not in result.measured
    assert mesh_of(tmp_path, 4) is None


# CP2 x DP2 (fsdp): mesh (pp, dp_replicate, dp_shard, cp, tp) = (1, 1, 2, 2, 1); cp is inside dp_shard.
CP2_DP2 = {"pp": 1, "dp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1, "ep": 1}


def _cp2_dp2_ranks() -> list[dict[str, Any]]:
    """A context-parallel job's records, written out by hand: cp groups {0, 1}, {2, 3}; dp groups {0, 2}, {1, 3}."""
    out = []
    for rank in range(4):
        dp_shard, cp = divmod(rank, 2)
        coords = {"pp": 0, "dp": dp_shard, "dp_replicate": 0, "dp_shard": dp_shard, "cp": cp, "tp": 0, "ep": 0}
        groups = {"cp": _group([2 * dp_shard, 2 * dp_shard + 1]), "dp": _group([cp, 2 + cp])}
        out.append({"rank": rank, "local_rank": rank, "host": "h", "backend": "gloo",
                    "collective": {"all_reduce_sum": 10.0, "all_reduce_expected": 10.0, "broadcast_ok": True},
                    "mesh": {"dims": CP2_DP2, "coords": coords, "groups": groups}})  # fmt: skip
    return out


def test_context_parallel_peers_are_checked_like_the_other_sub_groups(tmp_path: Path) -> None:
    clean = _connectivity(tmp_path / "clean", _cp2_dp2_ranks())
    assert clean.passed, clean.message
    assert clean.measured["mesh"]["groups_checked"] == {"cp": 4, "dp": 4}
    wrong = _cp2_dp2_ranks()
    wrong[1]["mesh"]["groups"]["cp"] = _group([1, 3])  # a "cp" group across data-parallel ranks
    wrong[3]["mesh"]["groups"]["cp"]["all_reduce_sum"] = 4.0
    del wrong[2]["mesh"]["groups"]["cp"]
    result = _connectivity(tmp_path / "wrong", wrong)
    assert not result.passed
    assert "rank 1: its cp group is ranks [1, 3], its coordinates" in result.message
    assert "rank 3: the all-reduce over its cp group (ranks [2, 3]) gave 4.0, expected 7.0" in result.message
    assert "rank 2: no collective recorded on its cp group(s)" in result.message


def _metrics(compute: dict[int, float], comm_s: float | None = 0.002) -> dict[int, dict[int, StepRecord]]:
    return {
        rank: {
            s: StepRecord(rank=rank, step=s, loss=3.0, tokens_per_s=1000.0, step_time_s=c + 0.01, compute_s=c,
                          comm_s=comm_s, data_wait_s=0.0, comm_bytes={"tp": 1000.0 * s, "dp": 10.0})
            for s in range(1, 21)
        }
        for rank, c in compute.items()
    }  # fmt: skip


def _pp2_dp2_mesh(tmp_path: Path):  # noqa: ANN202
    dims = {"pp": 2, "dp": 2, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "ep": 1}
    ranks = []
    for rank, (pp, dp) in enumerate(itertools.product(range(2), range(2))):
        coords = {"pp": pp, "dp": dp, "dp_replicate": 0, "dp_shard": dp, "cp": 0, "tp": 0, "ep": 0}
        groups = {"pp": _group([dp, 2 + dp]), "dp": _group([2 * pp, 2 * pp + 1])}
        ranks.append({"rank": rank, "local_rank": rank, "host": "h", "backend": "gloo",
                      "collective": {"all_reduce_sum": 10.0, "all_reduce_expected": 10.0, "broadcast_ok": True},
                      "mesh": {"dims": dims, "coords": coords, "groups": groups}})  # fmt: skip
    RunOutputWriter(str(tmp_path), StorageConfig()).write_ranks(Ranks(4, ranks))
    assert check_connectivity(tmp_path, 4).passed
    return mesh_of(tmp_path, 4)


LIMITS = AcceptanceThresholds(scaling_efficiency_min=0.01, comm_share_max=1.0)
REFERENCE = {s: StepRecord(step=s, loss=3.0, tokens_per_s=1000.0) for s in range(1, 21)}


def test_pipeline_stages_doing_different_work_are_no_stragglers_but_a_slow_stage_peer_is(tmp_path: Path) -> None:
    mesh = _pp2_dp2_mesh(tmp_path)
    stages = _metrics({0: 0.010, 1: 0.010, 2: 0.016, 3: 0.016})  # the last stage computes the loss
    flat = check_performance(stages, REFERENCE, 4, LIMITS, sharding="fsdp")
    assert not flat.passed and flat.measured["slow_rank"] in (2, 3)  # judged as data parallel: false stragglers
    perf = check_performance(stages, REFERENCE, 4, LIMITS, sharding="fsdp", mesh=mesh)
    assert perf.passed, perf.message
    assert perf.measured["layout"] == "pp2 x dp2 (fsdp)"
    assert perf.measured["comm_bytes_per_dim"] == {"dp": 10.0, "tp": 11500.0}  # steps 3-20: warmup left out
    slow = check_performance(_metrics({0: 0.010, 1: 0.016, 2: 0.016, 3: 0.016}), REFERENCE, 4, LIMITS,
                             sharding="fsdp", mesh=mesh)  # fmt: skip
    assert not slow.passed and slow.measured["slow_rank"] == 1
    assert "rank 1 computes" in slow.message and "the other pipeline stage 0 ranks'" in slow.message


def test_gradient_sync_is_judged_over_the_data_parallel_ranks(tmp_path: Path) -> None:
    mesh = _pp2_dp2_mesh(tmp_path)
    silent = check_performance(_metrics(dict.fromkeys(range(4), 0.01), 0.0), REFERENCE, 4, LIMITS,
                               sharding="fsdp", mesh=mesh)  # fmt: skip
    assert not silent.passed and "no gradient synchronisation measured" in silent.message
    one_replica = copy.deepcopy(mesh)
    one_replica.dims = {**mesh.dims, "dp_shard": 1}  # pp2 x dp1: nothing to synchronise
    quiet = check_performance(_metrics(dict.fromkeys(range(4), 0.01), None), REFERENCE, 4, LIMITS,
                              sharding="fsdp", mesh=one_replica)  # fmt: skip
    assert quiet.passed, quiet.message


def _train(parallel: dict[str, Any], tmp_path: Path) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": {"n_layers": 2, "d_model": 32, "n_heads": 4, "ffn_hidden": 64, "vocab_size": 256, "seq_len": 16},
        "parallel": {"micro_batch": 2, "grad_accum_steps": 2, **parallel},
        "optim": {"lr_peak": 1e-3}, "data": {"dataset_url": str(tmp_path)},
        "checkpoint": {"url": str(tmp_path / "c")}, "run": {"steps": 10, "output_url": str(tmp_path / "o")},
    })  # fmt: skip


FOUR = ClusterConfig(scheduler="local", nodes=1, procs_per_node=4, accelerator="cpu")


def test_a_tp2_dp2_job_reshards_to_dp4_keeping_the_global_batch(tmp_path: Path) -> None:
    train = _train({"tensor_parallel": 2, "sequence_parallel": True, "sharding": "fsdp"}, tmp_path)
    flat = data_parallel_layout(FOUR, train)
    assert flat is not None and flat["tensor_parallel"] == 1 and not flat["sequence_parallel"]
    assert flat["micro_batch"] * flat["grad_accum_steps"] * 4 == 2 * 2 * 2  # dp2's global batch of 8
    assert Layout.of(train.parallel, FOUR.world_size, FOUR.procs_per_node).degrees() == "dp2 x tp2 (fsdp)"
    resharded = train.model_copy(update={"parallel": train.parallel.model_copy(update=flat)})
    assert Layout.of(resharded.parallel, FOUR.world_size, FOUR.procs_per_node).degrees() == "dp4 (fsdp)"
    assert data_parallel_layout(FOUR, _train({}, tmp_path)) is None  # a data-parallel job reshards to one rank
    _, sections = single_process(FOUR, train)
    assert sections["parallel"]["micro_batch"] == 4 and sections["parallel"]["tensor_parallel"] == 1


def test_the_reshard_falls_back_to_one_rank_when_the_batch_does_not_divide(tmp_path: Path) -> None:
    train = _train({"pipeline_parallel": 2, "micro_batch": 1}, tmp_path)  # dp2 x 1 x 2 = 4 sequences, 1 a rank
    flat = data_parallel_layout(FOUR, train)
    assert flat is not None and (flat["micro_batch"], flat["grad_accum_steps"]) == (1, 1)
    odd = _train({"tensor_parallel": 2, "micro_batch": 3, "grad_accum_steps": 1}, tmp_path)  # dp2 x 3 = 6 sequences
    assert data_parallel_layout(FOUR, odd) is None  # 6 do not divide over 4 ranks: reshard to one rank instead


class _HundredSamples:
    """A training split of 100 samples from one source (what Sampling.of reads of a TokenDataset)."""

    manifest = SimpleNamespace(blend=[])

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __len__(self) -> int:
        return 100


def test_sampling_of_a_model_parallel_run_is_over_its_data_parallel_ranks(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr("training.workload.TokenDataset", _HundredSamples)  # the lm workload opens the split
    train = _train({"tensor_parallel": 2, "pipeline_parallel": 2}, tmp_path)
    sampling = Sampling.of(train, 8)
    assert sampling.world_size == 2 and sampling.global_batch == 2 * 2 * 2 and sampling.n_samples == 100


def test_the_rank_kill_drill_kills_a_rank_inside_a_tensor_parallel_group() -> None:
    assert kill_victim(_tp2_dp2_ranks()) == (1, _tp2_dp2_ranks()[1]["mesh"]["coords"])
    plain = [{k: v for k, v in r.items() if k != "mesh"} for r in _tp2_dp2_ranks()]
    assert kill_victim(plain) == (1, None)
    assert kill_victim(plain[:1]) == (0, None)
