"""Pipeline parallelism (training/pipeline.py) against the single-process model: losses, gradients, the optimizer
step, evaluation and the full-model state-dict names, on gloo with 2 and 4 real processes.

Each spawn runs several layouts one after another (the processes are started once per world size); every rank
writes what it measured to a JSON file and the tests compare it with the reference each rank also computed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.launch.torchrun import free_port
from tests.processes import start_group, stop_group

REPO = Path(__file__).resolve().parents[3]
TOLERANCE = 1e-5
WORKER_MODULE = "tests.integration.parallel.test_pipeline"

# Layouts on 2 processes (pipeline 2) and on 4 (pipeline 2 x data 2 with FSDP2 per chunk over meshes.dp, or
# pipeline 2 x tensor 2 through training.parallel.apply_model_parallel, the trainer's parallelize_chunk).
TWO_RANKS: dict[str, dict[str, Any]] = {
    "1f1b": {"layers": 2, "parallel": {"pipeline_schedule": "1f1b"}},
    "gpipe": {"layers": 2, "parallel": {"pipeline_schedule": "gpipe"}},
    "interleaved": {"layers": 4, "parallel": {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2}},
    "uneven": {"layers": 3, "parallel": {"pipeline_schedule": "1f1b", "pipeline_split": [2, 1]}},
}
FOUR_RANKS: dict[str, dict[str, Any]] = {
    "1f1b-fsdp": {"layers": 2, "fsdp": True, "parallel": {"pipeline_schedule": "1f1b", "sharding": "fsdp"}},
    "interleaved-fsdp": {
        "layers": 4,
        "fsdp": True,
        "parallel": {"pipeline_schedule": "interleaved-1f1b", "virtual_stages": 2, "sharding": "fsdp"},
    },
    "tp2": {"layers": 2, "tp": True, "parallel": {"pipeline_schedule": "1f1b", "tensor_parallel": 2}},
    "tp2-sp-interleaved": {
        "layers": 4,
        "tp": True,
        "parallel": {
            "pipeline_schedule": "interleaved-1f1b",
            "virtual_stages": 2,
            "tensor_parallel": 2,
            "sequence_parallel": True,
        },  # fmt: skip
    },
}


def _config(layout: dict[str, Any]) -> Any:
    from training.config import TrainConfig  # noqa: PLC0415 - workers import torch only when they run

    return TrainConfig.model_validate(
        {
            "model": {
                "n_layers": layout["layers"],
                "d_model": 32,
                "n_heads": 4,
                "n_kv_heads": 2,
                "ffn_hidden": 48,
                "vocab_size": 64 if layout.get("tp") else 61,
                "seq_len": 16,
            },  # fmt: skip
            "parallel": {"micro_batch": 2, "grad_accum_steps": 2, "pipeline_parallel": 2, **layout["parallel"]},
            "optim": {"lr_peak": 1e-2},
            "data": {"dataset_url": "/unused"},
            "checkpoint": {"url": "/unused"},
            "run": {"steps": 3, "seed": 5, "output_url": "/unused"},
        }
    )


def _clone(state: Any) -> Any:
    import torch  # noqa: PLC0415

    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _clone(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def _run_layout(name: str, layout: dict[str, Any]) -> dict[str, Any]:
    """One layout on this rank: the pipeline's measurements and the single-process reference's."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    from training.mesh import ParallelDims  # noqa: PLC0415
    from training.model import Transformer  # noqa: PLC0415
    from training.parallel import apply_model_parallel  # noqa: PLC0415
    from training.pipeline import build_pipeline  # noqa: PLC0415
    from training.tensor_parallel import lm_loss  # noqa: PLC0415

    cfg = _config(layout)
    world = dist.get_world_size()
    meshes = ParallelDims.from_config(cfg.parallel, world, world).build("cpu")
    dp, dp_rank = meshes.dims.dp, meshes.coords["dp"]
    per_rank = cfg.parallel.micro_batch * cfg.parallel.grad_accum_steps
    gen = torch.Generator().manual_seed(11)
    batches = [torch.randint(0, cfg.model.vocab_size, (dp * per_rank, cfg.model.seq_len + 1), generator=gen)
               for _ in range(3)]  # fmt: skip
    # 3 eval sequences per data-parallel rank: not a multiple of the 2 microbatches.
    evals = torch.randint(0, cfg.model.vocab_size, (dp * 3, cfg.model.seq_len + 1), generator=gen)

    def mine(batch: torch.Tensor) -> torch.Tensor:
        rows = batch.shape[0] // dp
        return batch[dp_rank * rows : (dp_rank + 1) * rows]

    torch.manual_seed(cfg.run.seed)
    model = Transformer(cfg.model)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=cfg.optim.lr_peak)

    def ref_loss(batch: torch.Tensor) -> torch.Tensor:
        return lm_loss(reference(batch[:, :-1])[0], batch[:, 1:])

    ref = {"step1": ref_loss(batches[0])}
    ref["step1"].backward()
    ref_grads = {n: p.grad.clone() for n, p in reference.named_parameters()}
    ref_opt.step()
    ref_opt.zero_grad()
    with torch.no_grad():
        ref["eval"] = ref_loss(evals)
        ref["step2"] = ref_loss(batches[1])

    def shard_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
        for block in chunk.blocks.values():
            fully_shard(block, mesh=meshes.dp)
        return fully_shard(chunk, mesh=meshes.dp)

    def model_parallel(chunk: torch.nn.Module) -> torch.nn.Module:
        return apply_model_parallel(chunk, cfg.parallel, meshes, None)

    parallelize = shard_chunk if layout.get("fsdp") else model_parallel if layout.get("tp") else lambda c: c
    pipe = build_pipeline(model, cfg, meshes, torch.device("cpu"), parallelize)
    opt = torch.optim.AdamW(pipe.model.parameters(), lr=cfg.optim.lr_peak)
    got: dict[str, Any] = {"step1": pipe.train_step(mine(batches[0]))}
    worst = 0.0
    for n, p in pipe.model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, float((grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max()))
    opt.step()
    opt.zero_grad()
    got["eval"] = pipe.eval_loss(mine(evals))
    got["step2"] = pipe.train_step(mine(batches[1]))
    opt.step()
    opt.zero_grad()

    # A get_state_dict/set_state_dict round trip restores parameters and optimizer state: the same step from
    # the restored state gives the same loss, and so does the loss after the optimizer step that follows.
    model_sd, optim_sd = get_state_dict(pipe.model, opt)
    saved = _clone(model_sd), _clone(optim_sd)
    again = []
    for _ in range(2):
        set_state_dict(pipe.model, opt, model_state_dict=_clone(saved[0]), optim_state_dict=_clone(saved[1]))
        loss = pipe.train_step(mine(batches[2]))
        opt.step()
        opt.zero_grad()
        again.append([loss, pipe.eval_loss(mine(batches[2]))])

    # The collectives of a step whose stage metadata is known (the schedule re-infers it, with real forward
    # and autograd.grad passes, after an eval).
    pipe.train_step(mine(batches[2]))
    opt.zero_grad()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pipe.train_step(mine(batches[2]))
    opt.zero_grad()

    def num(value: torch.Tensor | None) -> float | None:
        return None if value is None else float(value)

    return {
        "holds_last": pipe.holds_last,
        "dp_rank": dp_rank,
        "pp_rank": meshes.coords["pp"],
        "pipeline": {k: num(v) for k, v in got.items()},
        "reference": {k: float(v) for k, v in ref.items()},
        "grad_rel_dev": worst,
        "reduce_scatters": sum(e.name == "c10d::_reduce_scatter_base_" for e in prof.events()),
        # FSDP2 parameter groups here: each block, and each chunk root that holds the embedding or the head.
        "fsdp_groups": sum(
            len(c.blocks) + any(getattr(c, n) is not None for n in ("tok_emb", "norm", "lm_head")) for c in pipe.chunks
        ),  # fmt: skip
        "restored": [[num(v) for v in pair] for pair in again],
        "state_dict_keys": sorted(model_sd),
        "optim_state_keys": sorted(optim_sd["state"]),
        "model_keys": sorted(pipe.model.state_dict()),
        "full_keys": sorted(reference.state_dict()),
    }


def _worker(layouts: list[str], out_dir: str) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    table = {**TWO_RANKS, **FOUR_RANKS}
    results = {name: _run_layout(name, table[name]) for name in layouts}
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _spawn(world: int, layouts: list[str], out_dir: Path, timeout_s: float) -> list[dict[str, Any]]:
    """Run the layouts on `world` processes; every rank's results. Every process is stopped however it ends."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    logs = [out_dir / f"rank{r}.log" for r in range(world)]
    try:
        for rank in range(world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}  # fmt: skip
            with logs[rank].open("w") as log:
                cmd = [sys.executable, "-m", WORKER_MODULE, str(out_dir), *layouts]
                procs.append(start_group(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"pipeline workers did not finish in {timeout_s} s:\n" + logs[0].read_text()[-3000:])
    finally:
        for proc in procs:
            stop_group(proc, grace_s=2.0)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    assert not failed, f"ranks {failed} failed:\n" + "\n".join(logs[r].read_text()[-4000:] for r in failed)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(2, list(TWO_RANKS), tmp_path_factory.mktemp("pp2"), timeout_s=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _spawn(4, list(FOUR_RANKS), tmp_path_factory.mktemp("pp2dp2"), timeout_s=420)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _check_against_reference(ranks: list[dict[str, Any]], name: str) -> None:
    results = [r[name] for r in ranks]
    last = [r for r in results if r["holds_last"]]
    assert last and all(r["pipeline"]["step1"] is None for r in results if not r["holds_last"])
    # The tensor-parallel peers of one data-parallel rank on the last stage report the same loss.
    owners = {r["dp_rank"]: r for r in last}
    for r in last:
        assert r["pipeline"] == owners[r["dp_rank"]]["pipeline"], (name, r["pipeline"])
    last = list(owners.values())
    reference = last[0]["reference"]
    for key in ("step1", "eval", "step2"):
        # The data-parallel ranks' losses are means over equal shares: their mean is the global batch's mean.
        measured = sum(r["pipeline"][key] for r in last) / len(last)
        assert _rel(measured, reference[key]) < TOLERANCE, (name, key, measured, reference[key])
    for r in results:
        assert r["grad_rel_dev"] < TOLERANCE, (name, r["grad_rel_dev"])


@pytest.mark.timeout(360)
@pytest.mark.parametrize("layout", list(TWO_RANKS))
def test_two_stage_pipeline_matches_the_single_process_model(two_ranks: list[dict[str, Any]], layout: str) -> None:
    _check_against_reference(two_ranks, layout)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout", list(FOUR_RANKS))
def test_pipeline_with_data_or_tensor_parallel_matches_the_single_process_model(
    four_ranks: list[dict[str, Any]], layout: str
) -> None:
    _check_against_reference(four_ranks, layout)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("layout", [name for name, layout in FOUR_RANKS.items() if layout.get("fsdp")])
def test_fsdp_reduce_scatters_once_per_step_not_per_microbatch(four_ranks: list[dict[str, Any]], layout: str) -> None:
    for r in four_ranks:
        result = r[layout]
        # 2 microbatches: a gradient sync in every microbatch's backward would double the count.
        assert result["reduce_scatters"] == result["fsdp_groups"] > 0, (layout, result["reduce_scatters"])


@pytest.mark.timeout(780)
def test_the_stage_models_together_hold_the_full_model_under_its_names(
    two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]
) -> None:
    for ranks in (two_ranks, four_ranks):
        for name in ranks[0]:
            results = [r[name] for r in ranks]
            full = set(results[0]["full_keys"])
            for what in ("state_dict_keys", "model_keys", "optim_state_keys"):
                held = [set(r[what]) for r in results]
                assert set().union(*held) == full, (name, what, sorted(full ^ set().union(*held)))
            stage0, stage1 = ({k for r in results if r["pp_rank"] == s for k in r["model_keys"]} for s in (0, 1))
            assert not stage0 & stage1, (name, sorted(stage0 & stage1))


@pytest.mark.timeout(780)
def test_state_dict_round_trip_restores_parameters_and_optimizer_state(
    two_ranks: list[dict[str, Any]], four_ranks: list[dict[str, Any]]
) -> None:
    for ranks in (two_ranks, four_ranks):
        for name in ranks[0]:
            for r in ranks:
                first, second = r[name]["restored"]
                assert first == second, (name, first, second)
                if r[name]["holds_last"]:
                    assert first[0] is not None and first[1] is not None


if __name__ == "__main__":
    _worker(sys.argv[2:], sys.argv[1])
