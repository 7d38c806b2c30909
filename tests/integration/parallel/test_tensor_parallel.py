"""`apply_model_parallel` over four gloo processes against the single-process model on the same global batch:
tensor parallelism with and without sequence parallelism, composed with FSDP2 (replicating and sharding), and
expert parallelism under FSDP2.

The test starts this file under torchrun as the worker (`python -m torch.distributed.run ... OUT`); every rank
runs each layout in `LAYOUTS` as the trainer does: `apply_model_parallel`, forward and backward of its
data-parallel rank's share of a fixed global batch under `loss_context(tp > 1)` (in micro-steps without
gradient sync where the layout accumulates), clipping by the global norm (training/grad_clip.py), one AdamW
step and a second forward. Rank 0 saves the data-parallel mean losses, the whole gradients of a few sharded
weights, the gradient norms and the tensor-parallel collectives of the first micro-batch (training/comm_counter.py);
the test computes the same in one process.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.launch.torchrun import free_port
from training.config import ModelConfig, MoEConfig

WORLD, GLOBAL_BATCH, LR, MAX_NORM = 4, 4, 1e-2, 0.5
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2xdp2": {"sharding": "ddp", "sequence_parallel": False},
    "tp2xdp2_sp": {"sharding": "ddp", "sequence_parallel": True, "recompute": "full"},
    "fsdp2xtp2": {"sharding": "fsdp", "sequence_parallel": False, "recompute": "selective", "accum": 2},
    "fsdp2xtp2_sp_tied_gelu": {"sharding": "fsdp", "sequence_parallel": True, "tie": True, "mlp": "gelu"},
    # dp 4 with experts over ep 2: each expert's FSDP2 group is the 2 ranks holding it, its gradient / 4.
    "ep2_fsdp4_moe": {"sharding": "fsdp", "sequence_parallel": False, "tp": 1, "ep": 2},
}
# Column-wise, row-wise, vocabulary-parallel, replicated (norm) and tied weights.
CHECKED = [
    "blocks.0.attn.wq.weight", "blocks.1.attn.wo.weight", "blocks.0.mlp.w1.weight", "blocks.1.mlp.w2.weight",
    "tok_emb.weight", "lm_head.weight", "blocks.0.attn_norm.weight", "norm.weight",
    "blocks.0.mlp.router.weight", "blocks.0.mlp.experts.0.w1.weight", "blocks.1.mlp.experts.1.w2.weight",
]  # fmt: skip


def _cfg(layout: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=96, seq_len=16, dropout=0.0,
        mlp=layout.get("mlp", "swiglu"), tie_embeddings=layout.get("tie", False),
        moe=MoEConfig(n_experts=4, top_k=2) if layout.get("ep", 1) > 1 else None,
    )  # fmt: skip


def _loss(logits: torch.Tensor, aux: torch.Tensor, targets: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    from training.tensor_parallel import lm_loss

    return lm_loss(logits, targets) + (cfg.moe.aux_loss_coef * aux if cfg.moe else 0.0)


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len + 1), generator=generator)


def _run_layout(layout: dict[str, Any], meshes_for: Any, labels: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    import torch.distributed as dist

    from training.comm_counter import TrafficCounter, group_labels
    from training.config import ParallelConfig
    from training.grad_clip import clip_grad_norm
    from training.metrics import CommTimer
    from training.model import Transformer
    from training.parallel import apply_model_parallel
    from training.tensor_parallel import local_value, loss_context

    cfg, accum, tp = _cfg(layout), layout.get("accum", 1), layout.get("tp", 2)
    par = ParallelConfig(
        sharding=layout["sharding"], micro_batch=GLOBAL_BATCH // (WORLD // tp) // accum, grad_accum_steps=accum,
        tensor_parallel=tp, sequence_parallel=layout["sequence_parallel"], expert_parallel=layout.get("ep", 1),
        activation_recompute=layout.get("recompute", "none"),
    )  # fmt: skip
    meshes = meshes_for(par)
    torch.manual_seed(0)
    model = Transformer(cfg, recompute=par.activation_recompute)
    timer = CommTimer()
    wrapped = apply_model_parallel(model, par, meshes, timer)
    optimizer = torch.optim.AdamW(wrapped.parameters(), lr=LR)
    rows = _tokens(cfg).chunk(meshes.dims.dp)[meshes.coords["dp"]]
    dp_group = meshes.dp_flat.get_group()

    def dp_mean(value: torch.Tensor) -> float:
        value = value.detach().clone()
        dist.all_reduce(value, group=dp_group)
        return value.item() / meshes.dims.dp

    local = torch.zeros(())
    # DTensor caches its plans by mesh, and meshes of the same ranks compare equal: a layout's collectives may run
    # on the groups of an earlier layout's mesh, so every mesh built so far names its groups.
    labels.update(group_labels(meshes))
    counter = TrafficCounter(labels=labels)
    for i, micro in enumerate(rows.chunk(accum)):
        wrapped.set_requires_gradient_sync(i == accum - 1)  # the trainer's accumulation pattern
        with loss_context(tp > 1), counter if i == 0 else contextlib.nullcontext():
            logits, aux = wrapped(micro[:, :-1])
            loss = _loss(logits, aux, micro[:, 1:], cfg) / accum
            loss.backward()
        local += local_value(loss).detach()
    params = dict(wrapped.named_parameters())
    # clone: full_tensor() of a replicated gradient is the gradient itself, which clipping scales in place
    grads = {n: params[n].grad.full_tensor().clone() for n in CHECKED if n in params}
    norm = clip_grad_norm(wrapped, MAX_NORM, meshes)
    result = {
        "loss": dp_mean(local),
        "grads": grads,
        "grad_norm": norm.item(),
        "clipped_norm": clip_grad_norm(wrapped, float("inf"), meshes).item(),
        "comm_s": timer.take(),
        "tied": cfg.tie_embeddings and wrapped.lm_head.weight is wrapped.tok_emb.weight,
        "tp_ops": {op: n for op, n in counter.ops.items() if op.startswith("tp:")},
        "params": sorted(params),
    }
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad(), loss_context(tp > 1):
        logits, aux = wrapped(rows[:, :-1])
        result["loss_after_step"] = dp_mean(local_value(_loss(logits, aux, rows[:, 1:], cfg)))
    return result


def _worker(out: Path) -> None:
    """One of the four ranks: every layout in turn; rank 0 saves the results to OUT/results.pt."""
    import torch.distributed as dist

    from training.mesh import ParallelDims

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    built: dict[ParallelDims, Any] = {}

    def meshes_for(par: Any) -> Any:
        dims = ParallelDims.from_config(par, WORLD, WORLD)
        if dims not in built:
            built[dims] = dims.build("cpu")
        return built[dims]

    labels: dict[str, tuple[str, ...]] = {}
    results = {name: _run_layout(layout, meshes_for, labels) for name, layout in LAYOUTS.items()}
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run every layout once under torchrun on four processes; rank 0's results."""
    from tests.processes import run_group

    out = tmp_path_factory.mktemp("tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = run_group(cmd, timeout=480, env=env)  # minutes on a loaded 2-core machine
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(out / "results.pt", weights_only=False)


@functools.cache
def _reference(name: str) -> dict[str, Any]:
    """The single-process model on the whole batch (the mean of the data-parallel ranks' losses, each with the
    load-balancing loss of its own tokens): loss, gradients, gradient norm, loss after one clipped step."""
    from training.model import Transformer

    layout = LAYOUTS[name]
    cfg = _cfg(layout)
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    shares = _tokens(cfg).chunk(WORLD // layout.get("tp", 2))

    def loss_of() -> torch.Tensor:
        return torch.stack([_loss(*model(rows[:, :-1]), rows[:, 1:], cfg) for rows in shares]).mean()

    loss = loss_of()
    loss.backward()
    params = dict(model.named_parameters())
    result = {
        "loss": loss.item(),
        "grads": {n: params[n].grad.clone() for n in CHECKED if n in params},
        "grad_norm": torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item(),
        "params": sorted(params),
    }
    optimizer.step()
    with torch.no_grad():
        result["loss_after_step"] = loss_of().item()
    return result


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_the_single_process_model_before_and_after_an_optimizer_step(
    results: dict[str, dict[str, Any]], layout: str
) -> None:
    ref, got = _reference(layout), results[layout]
    assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5), (got["loss"], ref["loss"])
    # The step moved the loss, and by the same amount: the gradients (with their data-parallel mean) agree.
    assert abs(ref["loss_after_step"] - ref["loss"]) > 1e-3
    assert math.isclose(got["loss_after_step"], ref["loss_after_step"], rel_tol=1e-5)
    # Full-model names (an EP rank holds some of the experts), so checkpoints map one to one.
    assert set(got["params"]) <= set(ref["params"])
    assert LAYOUTS[layout].get("ep", 1) > 1 or got["params"] == ref["params"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_weights_get_the_single_process_gradients(results: dict[str, dict[str, Any]], layout: str) -> None:
    ref, got = _reference(layout), results[layout]
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_clipping_uses_the_global_gradient_norm(results: dict[str, dict[str, Any]], layout: str) -> None:
    ref, got = _reference(layout), results[layout]
    assert ref["grad_norm"] > MAX_NORM
    assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5)
    assert math.isclose(got["clipped_norm"], MAX_NORM, rel_tol=1e-4)


@pytest.mark.timeout(600)
def test_tied_embeddings_stay_one_parameter_under_tensor_parallelism(results: dict[str, dict[str, Any]]) -> None:
    assert results["fsdp2xtp2_sp_tied_gelu"]["tied"]
    assert "lm_head.weight" not in results["fsdp2xtp2_sp_tied_gelu"]["params"]


# TP collectives of one micro-batch's forward and backward with 2 blocks: Megatron's one per region (attention,
# MLP) each way, the embedding's (forward) and the output layer's (backward), and loss_parallel's three small
# all-reduces. A plain input per column-wise projection made it 5 per block in backward (q, k, v, gate, up).
# With sequence parallelism each all-reduce is an all-gather and a reduce-scatter (and the 5 norms' weight
# gradients, d_model values each, are summed over the sequence shards); a full recompute adds the attention's
# gather and reduce-scatter and the MLP's gather (the checkpoint stops before the MLP's output).
TP_OPS = {
    "tp2xdp2": {"tp:all_reduce": 2 * 4 + 2 + 3},
    "fsdp2xtp2": {"tp:all_reduce": 2 * 4 + 2 + 3},
    "tp2xdp2_sp": {"tp:all_gather_into_tensor": 2 * (4 + 2) + 2, "tp:reduce_scatter_tensor": 2 * (4 + 1) + 2,
                   "tp:all_reduce": 3 + 5},
    "fsdp2xtp2_sp_tied_gelu": {"tp:all_gather_into_tensor": 2 * 4 + 2, "tp:reduce_scatter_tensor": 2 * 4 + 2,
                               "tp:all_reduce": 3 + 5},
    "ep2_fsdp4_moe": {},
}  # fmt: skip


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_block_sends_megatrons_count_of_tensor_parallel_collectives(
    results: dict[str, dict[str, Any]], layout: str
) -> None:
    assert results[layout]["tp_ops"] == TP_OPS[layout]


@pytest.mark.timeout(600)
def test_fsdp_collectives_are_timed(results: dict[str, dict[str, Any]]) -> None:
    assert results["fsdp2xtp2"]["comm_s"] > 0


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
