"""Self-check of a model-parallel layout: run it on this machine and compare its traffic with the planner's.

It joins the spec, the data preparation, the trainer and the planner, so it sits above tasks/capacity and
tasks/spec (both of which it imports) rather than inside either.

The spec's own model rarely fits one CPU machine, so a tiny model of the same kind (MLP, experts, tied or not)
runs the spec's layout shape on at most 4 gloo processes (tensor, pipeline and expert degrees capped at 2, the
schedule, sequence parallelism and sharding kept) under the real trainer with tasks/capacity/traffic.py's
counter. The comparison: bytes per step each dimension sends (the busiest rank) and the parameter bytes a rank
holds, measured against the planner's figures for that same tiny layout.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from tasks.capacity.memory import MemoryModel, Precision
from tasks.capacity.params import Architecture
from tasks.capacity.plan import requested_layout
from tasks.capacity.step import CapacityInputs
from tasks.capacity.traffic import DIMS, PLANNER_KEYS, measure
from tasks.launch.cluster import ClusterConfig
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import DeploymentSpec, parse_spec
from training.config import ModelConfig, ParallelConfig, PrecisionConfig
from training.storage import StorageConfig

log = logging.getLogger(__name__)

MAX_PROCS = 4
STEPS, MEASURED = (5, (2, 4))


def tiny_layout(model: ModelConfig, parallel: ParallelConfig) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(model, parallel, processes) of a tiny model running the spec's layout shape on <= 4 processes."""
    tp, pp, ep = (min(d, 2) for d in (parallel.tensor_parallel, parallel.pipeline_parallel, parallel.expert_parallel))
    interleaved = pp > 1 and parallel.pipeline_schedule == "interleaved-1f1b"
    virtual = 2 if interleaved else 1
    dp = max(ep, 2 if tp * pp * 2 <= MAX_PROCS else 1)
    tiny: dict[str, Any] = {
        "n_layers": 2 * pp * virtual, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
        "vocab_size": 258, "seq_len": 32, "mlp": model.mlp, "tie_embeddings": model.tie_embeddings and pp == 1,
    }  # fmt: skip
    if model.moe is not None:
        tiny["moe"] = {"n_experts": 4, "top_k": min(model.moe.top_k, 2)}
    sharding = parallel.sharding if parallel.sharding != "hsdp" or dp > 2 else "fsdp"
    par: dict[str, Any] = {
        "sharding": sharding, "tensor_parallel": tp, "sequence_parallel": parallel.sequence_parallel and tp > 1,
        "pipeline_parallel": pp, "expert_parallel": ep, "micro_batch": 2,
        "grad_accum_steps": 2 * pp if pp > 1 else 2, "activation_recompute": parallel.activation_recompute,
    }  # fmt: skip
    if pp > 1:
        par |= {"pipeline_schedule": parallel.pipeline_schedule, "virtual_stages": virtual}
    return tiny, par, tp * pp * dp


def tiny_spec(
    model: dict[str, Any], parallel: dict[str, Any], procs: int, work: Path, dataset: str, *,
    steps: int = STEPS, name: str = "self-check",
) -> DeploymentSpec:  # fmt: skip
    """A one-node spec of `procs` CPU processes for measuring a layout: fp32, no checkpoints, one eval batch."""
    return parse_spec(
        {
            "name": name,
            "cluster": {"scheduler": "local", "nodes": 1, "procs_per_node": procs, "accelerator": "cpu"},
            "model": model,
            "parallel": parallel,
            "precision": {"dtype": "fp32"},
            "optim": {"lr_peak": 1e-3, "warmup_steps": 1},
            "data": {"dataset_url": dataset},
            "checkpoint": {"url": str(work / "ckpt"), "save_every_steps": None, "save_at_end": False},
            "run": {
                "steps": steps,
                "output_url": str(work / "out"),
                "eval_batches": 1,
                "log_every_steps": 100,
                "threads_per_rank": 1,
            },
        }  # fmt: skip
    )


def _dataset(work: Path) -> str:
    cfg = PrepareConfig(
        output_url=str(work / "data"), builtin_corpus="python-docs", builtin_max_bytes=200_000,
        tokenizer={"kind": "bytes"}, workers=1,
    )  # fmt: skip
    return prepare_dataset(cfg, StorageConfig(), validate=False).dataset_url


def run_parallel_self_check(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    cluster: ClusterConfig,
    work: Path | None = None,
    timeout_s: float = 900,
) -> dict[str, Any]:
    """Train a tiny model in the spec's layout shape on this machine; its traffic and weights against the plan."""
    del precision, cluster  # the tiny run is fp32 on this machine's CPU processes
    started = time.perf_counter()
    root = work or Path(tempfile.mkdtemp(prefix="tdeploy-self-check-"))
    tiny_model, tiny_par, procs = tiny_layout(model, parallel)
    spec = tiny_spec(tiny_model, tiny_par, procs, root, _dataset(root))
    config = root / "run.json"
    spec.training_config().to_json_file(config)
    traffic = measure(config, procs, root / "traffic", MEASURED, timeout_s)
    plan = CapacityInputs.of(spec).estimate()
    layout = requested_layout(spec.capacity, spec.cluster, spec.parallel)
    predicted = plan.requested.comm.bytes
    memory = MemoryModel(Architecture.from_model_config(spec.model), Precision.of("fp32")).estimate(layout)
    dims = {}
    for dim in DIMS:
        measured, expected = traffic.sent(dim), predicted[PLANNER_KEYS[dim]]
        if measured or expected:
            dims[dim] = {
                "measured_bytes_per_step": measured,
                "predicted_bytes_per_step": expected,
                "ratio": measured / expected if expected else None,
            }
    weights = max(r.param_bytes for r in traffic.ranks)
    return {
        "kind": "traffic",
        "label": f"{layout.describe()} (tiny {tiny_model['n_layers']}L d64, {procs} gloo processes)",
        "device": f"cpu, gloo x{procs}, the real trainer",
        "layout": layout.describe(),
        "dims": dims,
        "measured_param_bytes": weights,
        "predicted_param_bytes": memory.weights,
        "tokens_per_s": traffic.tokens_per_s(skip=MEASURED[1]),
        "seconds": time.perf_counter() - started,
    }
