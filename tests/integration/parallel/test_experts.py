"""Expert parallelism over two gloo processes against the single-process dense MoE model.

The test starts this file under torchrun as the worker (`python -m torch.distributed.run ... test_experts.py
OUT`); each rank trains one forward/backward on its half of a fixed global batch with EP2 and saves its loss,
gradients and counters; the test computes the same with the dense model in one process and compares. One more
forward/backward runs under the trainer's own wrapping (training/parallel.py: FSDP2, the experts' unit on the
one rank that holds them) and gradient norm, which the comparison holds to the same gradients.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tasks.launch.torchrun import free_port
from training.config import ModelConfig, MoEConfig
from training.model import Transformer

CFG = ModelConfig(
    n_layers=2,
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    ffn_hidden=48,
    vocab_size=97,
    seq_len=16,
    dropout=0.0,
    moe=MoEConfig(n_experts=4, top_k=2),
)
COEF = 0.01
GLOBAL_BATCH, WORLD = 4, 2
FACTORS = {"dropless": None, "capacity": 0.5}


def _tokens() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.seq_len + 1), generator=generator)


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CFG)


def _loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits, aux = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1)) + COEF * aux


def _worker(out: Path) -> None:
    """One EP2 rank: both scenarios, the trainer's FSDP2 wrapping, then the zero-token expert; results to
    OUT/rank<r>.pt."""
    import torch.distributed as dist

    from training.config import ParallelConfig
    from training.experts import apply_expert_parallel, set_capacity_factor, take_dropped_tokens
    from training.grad_clip import clip_grad_norm
    from training.mesh import ParallelDims
    from training.parallel import apply_model_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = ParallelDims(pp=1, dp_replicate=WORLD, dp_shard=1, cp=1, tp=1, ep=WORLD).build("cpu")
    dp_group, expert_dp_group = meshes.dp_flat.get_group(), meshes.expert_dp.get_group()
    half = _tokens().chunk(WORLD)[meshes.coords["dp"]]
    result: dict[str, object] = {"rank": rank, "coords": dict(meshes.coords)}
    for name, factor in FACTORS.items():
        model = _model()
        set_capacity_factor(model, factor)
        apply_expert_parallel(model, meshes)
        splits: list[list[int]] = []
        for block in model.blocks.values():
            dispatch = block.mlp.dispatch

            def recording(moe, rows, counts, dispatch=dispatch, splits=splits):  # noqa: ANN001, ANN202 - test probe
                local = len(moe.experts)
                splits.append([sum(counts[r * local : (r + 1) * local]) for r in range(WORLD)])
                return dispatch(moe, rows, counts)

            block.mlp.dispatch = recording
        loss = _loss(model, half)
        loss.backward()
        # The caller's gradient synchronisation, written with torch's collectives: mean over the data-parallel
        # ranks, experts over the ranks holding the same experts (here one), both divided by dp.
        grads = {}
        for pname, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=expert_dp_group if ".experts." in pname else dp_group)
            grads[pname] = grad / WORLD
        result[name] = {
            "loss": loss.item(),
            "grads": grads,
            "splits": splits,
            "dropped": take_dropped_tokens(model),
            "dropped_after_take": take_dropped_tokens(model),
            "keys": sorted(model.state_dict()),
        }

    # The trainer's own synchronisation (training/parallel.py: FSDP2 over the data-parallel ranks, the experts a
    # unit over the ranks holding the same experts, here one) and its gradient norm (training/grad_clip.py).
    model = _model()
    apply_model_parallel(model, ParallelConfig(micro_batch=GLOBAL_BATCH // WORLD, expert_parallel=WORLD), meshes, None)
    _loss(model, half).backward()
    result["fsdp2"] = {
        "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},  # experts: this rank's own
        "grad_norm": clip_grad_norm(model, math.inf, meshes).item(),
    }

    # An expert that no token reaches (positive inputs, a negative router row) still gets a zero gradient.
    model = _model()
    apply_expert_parallel(model, meshes)
    moe = model.blocks["0"].mlp
    with torch.no_grad():
        moe.router.weight.copy_(torch.tensor([1.0, 2.0, 3.0, -1.0]).unsqueeze(1).expand(4, CFG.d_model))
    x = torch.rand(2, 8, CFG.d_model) + 0.1
    out_x, _ = moe(x)
    out_x.sum().backward()
    result["unreached"] = {k: v.w1.weight.grad for k, v in moe.experts.items()}
    torch.save(result, out / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Run the EP2 worker once under torchrun; each rank's saved results."""
    from tests.processes import run_group

    out = tmp_path_factory.mktemp("ep2")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={WORLD}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", __file__, str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    done = run_group(cmd, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _reference(factor: float | None) -> tuple[float, dict[str, torch.Tensor], list[int]]:
    """Mean over the halves of (loss + aux) of the dense model, its gradients, and each half's drops."""
    from training.experts import set_capacity_factor, take_dropped_tokens

    model = _model()
    set_capacity_factor(model, factor)
    losses, dropped = [], []
    for half in _tokens().chunk(WORLD):
        losses.append(_loss(model, half))
        dropped.append(take_dropped_tokens(model))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, dropped


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", list(FACTORS))
def test_expert_parallel_matches_the_dense_model_on_the_whole_batch(ranks: list[dict], scenario: str) -> None:
    ref_loss, ref_grads, ref_dropped = _reference(FACTORS[scenario])
    results = [r[scenario] for r in ranks]
    assert math.isclose(sum(r["loss"] for r in results) / WORLD, ref_loss, rel_tol=1e-5)
    for rank, result in enumerate(results):
        experts = {n for n in result["grads"] if ".experts." in n}
        mine = {str(e) for e in range(rank * 2, rank * 2 + 2)}
        assert {n.split(".experts.")[1].split(".")[0] for n in experts} == mine
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        assert result["dropped"] == ref_dropped[rank]
        assert result["dropped_after_take"] == 0
    # the two EP checkpoints' keys together are exactly the whole model's
    assert set(results[0]["keys"]) | set(results[1]["keys"]) == set(_model().state_dict())


@pytest.mark.timeout(300)
def test_the_trainers_fsdp2_units_give_every_expert_the_dense_models_gradient(ranks: list[dict]) -> None:
    # The experts' unit reduces over a one-rank group: each gradient is divided by dp once, as the dense
    # parameters' are (gloo forced to sum had divided it twice, halving every expert's gradient at dp=2).
    _, ref_grads, _ = _reference(None)
    for rank, result in enumerate(r["fsdp2"] for r in ranks):
        experts = {n.split(".experts.")[1].split(".")[0] for n in result["grads"] if ".experts." in n}
        assert experts == {str(e) for e in range(rank * 2, rank * 2 + 2)}
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)
        reference_norm = torch.nn.utils.get_total_norm(list(ref_grads.values())).item()
        assert math.isclose(result["grad_norm"], reference_norm, rel_tol=1e-5), (result["grad_norm"], reference_norm)


@pytest.mark.timeout(300)
def test_capacity_drops_are_counted_and_dropless_drops_nothing(ranks: list[dict]) -> None:
    assert all(r["capacity"]["dropped"] > 0 for r in ranks)
    assert all(r["dropless"]["dropped"] == 0 for r in ranks)


@pytest.mark.timeout(300)
def test_tokens_reach_the_ranks_in_uneven_splits(ranks: list[dict]) -> None:
    splits = [s for r in ranks for s in r["dropless"]["splits"]]
    assert len(splits) == WORLD * CFG.n_layers
    assert any(len(set(s)) > 1 for s in splits), splits


@pytest.mark.timeout(300)
def test_an_expert_no_token_reaches_still_gets_a_zero_gradient(ranks: list[dict]) -> None:
    unreached = ranks[1]["unreached"]
    assert set(unreached) == {"2", "3"}
    assert unreached["3"] is not None and torch.count_nonzero(unreached["3"]) == 0
    assert torch.count_nonzero(unreached["2"]) > 0


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
