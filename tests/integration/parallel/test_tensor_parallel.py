"""Tensor parallelism (with and without sequence parallelism) composed with FSDP2 over four gloo processes,
against the single-process model on the same global batch.

The test starts this file under torchrun as the worker (`python -m torch.distributed.run ... OUT`); every rank
runs each layout in `LAYOUTS`: `apply_model_parallel`, forward and backward of its data-parallel rank's half of
a fixed global batch under `loss_context(True)` (in micro-steps without gradient sync where the layout
accumulates), one AdamW step and a second forward. Rank 0 saves the data-parallel mean losses, the whole
gradients of a few sharded weights and the global gradient norm; the test computes the same in one process.
"""

from __future__ import annotations

import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from training.config import ModelConfig

WORLD, TP, GLOBAL_BATCH, LR = 4, 2, 4, 1e-2
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2xdp2": {"sharding": "ddp", "sequence_parallel": False},
    "tp2xdp2_sp": {"sharding": "ddp", "sequence_parallel": True, "recompute": "full"},
    "fsdp2xtp2": {"sharding": "fsdp", "sequence_parallel": False, "recompute": "selective", "accum": 2},
    "fsdp2xtp2_sp_tied_gelu": {"sharding": "fsdp", "sequence_parallel": True, "tie": True, "mlp": "gelu"},
}
# Column-wise, row-wise, vocabulary-parallel, replicated (norm) and tied weights.
CHECKED = ["blocks.0.attn.wq.weight", "blocks.1.attn.wo.weight", "blocks.0.mlp.w1.weight", "blocks.1.mlp.w2.weight",
           "tok_emb.weight", "lm_head.weight", "blocks.0.attn_norm.weight", "norm.weight"]  # fmt: skip


def _cfg(layout: dict[str, Any]) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=96, seq_len=16, dropout=0.0,
        mlp=layout.get("mlp", "swiglu"), tie_embeddings=layout.get("tie", False),
    )  # fmt: skip


def _tokens(cfg: ModelConfig) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, cfg.seq_len + 1), generator=generator)


def _run_layout(layout: dict[str, Any], meshes_for: Any) -> dict[str, Any]:
    import torch.distributed as dist

    from training.config import ParallelConfig
    from training.metrics import CommTimer
    from training.model import Transformer
    from training.parallel import apply_model_parallel
    from training.tensor_parallel import lm_loss, local_value, loss_context

    cfg, accum = _cfg(layout), layout.get("accum", 1)
    par = ParallelConfig(sharding=layout["sharding"], micro_batch=GLOBAL_BATCH // (WORLD // TP) // accum,
                         grad_accum_steps=accum, tensor_parallel=TP, sequence_parallel=layout["sequence_parallel"],
                         activation_recompute=layout.get("recompute", "none"))  # fmt: skip
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
    for i, micro in enumerate(rows.chunk(accum)):
        wrapped.set_requires_gradient_sync(i == accum - 1)  # the trainer's accumulation pattern
        with loss_context(True):
            logits, _ = wrapped(micro[:, :-1])
            loss = lm_loss(logits, micro[:, 1:]) / accum
            loss.backward()
        local += local_value(loss).detach()
    params = dict(wrapped.named_parameters())
    grads = {n: params[n].grad.full_tensor() for n in CHECKED if n in params}
    norm = torch.nn.utils.get_total_norm([p.grad for p in params.values()])
    result = {
        "loss": dp_mean(local),
        "grads": grads,
        "grad_norm": norm.full_tensor().item(),
        "comm_s": timer.take(),
        "tied": cfg.tie_embeddings and wrapped.lm_head.weight is wrapped.tok_emb.weight,
        "params": sorted(params),
    }
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad(), loss_context(True):
        logits, _ = wrapped(rows[:, :-1])
        result["loss_after_step"] = dp_mean(local_value(lm_loss(logits, rows[:, 1:])))
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

    results = {name: _run_layout(layout, meshes_for) for name, layout in LAYOUTS.items()}
    if dist.get_rank() == 0:
        torch.save(results, out / "results.pt")
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Run every layout once under torchrun on four processes; rank 0's results."""
    from tests.processes import run_group

    out = tmp_path_factory.mktemp("tp")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={_free_port()}", __file__, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = run_group(cmd, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-6000:]
    return torch.load(out / "results.pt", weights_only=False)


def _reference(layout: dict[str, Any]) -> dict[str, Any]:
    """The single-process model on the whole batch: loss, gradients, gradient norm, loss after one step."""
    from training.model import Transformer

    cfg = _cfg(layout)
    torch.manual_seed(0)
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    tokens = _tokens(cfg)

    def loss_of() -> torch.Tensor:
        logits, _ = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(0, 1))

    loss = loss_of()
    loss.backward()
    params = dict(model.named_parameters())
    result = {
        "loss": loss.item(),
        "grads": {n: params[n].grad.clone() for n in CHECKED if n in params},
        "grad_norm": torch.nn.utils.get_total_norm([p.grad for p in params.values()]).item(),
        "params": sorted(params),
    }
    optimizer.step()
    with torch.no_grad():
        result["loss_after_step"] = loss_of().item()
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_match_the_single_process_model_before_and_after_an_optimizer_step(
    results: dict[str, dict[str, Any]], layout: str
) -> None:
    ref, got = _reference(LAYOUTS[layout]), results[layout]
    assert math.isclose(got["loss"], ref["loss"], rel_tol=1e-5), (got["loss"], ref["loss"])
    # The step moved the loss, and by the same amount: the gradients (with their data-parallel mean) agree.
    assert abs(ref["loss_after_step"] - ref["loss"]) > 1e-3
    assert math.isclose(got["loss_after_step"], ref["loss_after_step"], rel_tol=1e-5)
    assert got["params"] == ref["params"]  # full-model names, so checkpoints map one to one


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_weights_get_the_single_process_gradients(results: dict[str, dict[str, Any]], layout: str) -> None:
    ref, got = _reference(LAYOUTS[layout]), results[layout]
    assert set(got["grads"]) == set(ref["grads"])
    for name, grad in got["grads"].items():
        torch.testing.assert_close(grad, ref["grads"][name], rtol=1e-5, atol=1e-7, msg=name)
    assert math.isclose(got["grad_norm"], ref["grad_norm"], rel_tol=1e-5)


@pytest.mark.timeout(300)
def test_tied_embeddings_stay_one_parameter_under_tensor_parallelism(results: dict[str, dict[str, Any]]) -> None:
    assert results["fsdp2xtp2_sp_tied_gelu"]["tied"]
    assert "lm_head.weight" not in results["fsdp2xtp2_sp_tied_gelu"]["params"]


@pytest.mark.timeout(300)
def test_fsdp_collectives_are_timed(results: dict[str, dict[str, Any]]) -> None:
    assert results["fsdp2xtp2"]["comm_s"] > 0


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
