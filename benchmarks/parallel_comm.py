"""Bytes per mesh dimension per step, measured in the real trainer against the capacity planner's prediction.

For TP2xDP2, TP2xDP2+SP, PP2xDP2 (1F1B), TP2xPP2, FSDP2xTP2 on 4 gloo processes and EP2 (4-expert MoE) on 2,
the trainer (training/train.py under torchrun, run.json from a spec) runs a few steps of a tiny model with
tasks/capacity/traffic.py's counter on two of them. Per layout and dimension (dp, tp, pp, ep) it prints the bytes
the busiest rank sends per step (ring-equivalent, see traffic.py), the planner's bytes per GPU per step for the
same spec (tasks/capacity/comm.py) and their ratio; then tokens/s of each layout beside DDP on the same world size,
measured in the same run (CPU figures, for the record only). Every layout keeps the global batch at 16 sequences.
For the tensor-parallel layouts a third table gives TP bytes per block per step: measured (the layout's TP bytes less
the planner's share of the embedding, output layer and loss), planned, and before each region's column-wise
projections shared one input (each all-reduced its own input gradient: 2 + 3 + 2 all-reduces per SwiGLU block).

Usage: python benchmarks/parallel_comm.py [--steps 6] [--only tp2xdp2,ep2] [--work DIR]
(--work DIR again after changing the planner reprints the tables without measuring again.)
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from tasks.layout_check import tiny_spec
from tasks.capacity.comm import tensor_parallel_block_reduces
from tasks.capacity.traffic import DIMS, PLANNER_KEYS, RankTraffic, Traffic, measure
from tasks.capacity.step import CapacityInputs
from tasks.prepare.config import PrepareConfig
from tasks.prepare.pipeline import prepare_dataset
from tasks.spec import DeploymentSpec
from training.layout import Layout
from training.storage import StorageConfig

DENSE = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "vocab_size": 258,
         "seq_len": 32}  # fmt: skip
MOE = DENSE | {"n_layers": 2, "moe": {"n_experts": 4, "top_k": 2}}
# name: (model, parallel, processes, the DDP layout it is compared with); global batch 16 sequences everywhere.
LAYOUTS: dict[str, tuple[dict[str, Any], dict[str, Any], int, str]] = {
    "ddp4": (DENSE, {"micro_batch": 4, "grad_accum_steps": 1}, 4, "ddp4"),
    "tp2xdp2": (DENSE, {"tensor_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2}, 4, "ddp4"),
    "tp2xdp2+sp": (DENSE, {"tensor_parallel": 2, "sequence_parallel": True, "micro_batch": 4,
                           "grad_accum_steps": 2}, 4, "ddp4"),
    "pp2xdp2-1f1b": (DENSE, {"pipeline_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2}, 4, "ddp4"),
    "tp2xpp2": (DENSE, {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batch": 4, "grad_accum_steps": 4}, 4,
                "ddp4"),
    "fsdp2xtp2": (DENSE, {"sharding": "fsdp", "tensor_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2}, 4,
                  "ddp4"),
    "ddp2-moe": (MOE, {"micro_batch": 4, "grad_accum_steps": 2}, 2, "ddp2-moe"),
    "ep2": (MOE, {"expert_parallel": 2, "micro_batch": 4, "grad_accum_steps": 2}, 2, "ddp2-moe"),
}  # fmt: skip


def spec_for(work: Path, dataset: str, name: str, steps: int) -> DeploymentSpec:
    """The layout's spec: one node of `procs` CPU processes, fp32, no checkpoints (the self-check's)."""
    model, parallel, procs, _ = LAYOUTS[name]
    return tiny_spec(model, parallel, procs, work / name, dataset, steps=steps, name=f"comm-{name.replace('+', '-')}")


def run_layout(work: Path, dataset: str, name: str, steps: int) -> tuple[Traffic, dict[str, float], Layout]:
    """Measure the layout in the trainer; the planner's bytes per dimension for the same spec, and its layout."""
    spec = spec_for(work, dataset, name, steps)
    config = work / name / "run.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    spec.training_config().to_json_file(config)
    folder, procs = work / name / "traffic", spec.cluster.procs_per_node
    if (folder / f"rank{procs - 1}.json").exists():  # --work of an earlier run: its measurement, today's planner
        traffic = Traffic([RankTraffic(**json.loads((folder / f"rank{r}.json").read_text())) for r in range(procs)])
    else:
        traffic = measure(config, procs, folder, (2, 4), timeout_s=900)
    requested = CapacityInputs.of(spec).estimate().requested
    return traffic, {dim: requested.comm.bytes[PLANNER_KEYS[dim]] for dim in DIMS}, requested.layout


def _old_block_reduces(layout: Layout, mlp: str) -> float:
    """The planner's count before each region's projections shared one input DTensor (the payload's then)."""
    full = 2 if layout.recompute == "full" else 0
    return 4 + full if layout.sequence_parallel else 2 + 3 + (2 if mlp == "swiglu" else 1) + full


def tp_per_block(
    name: str, traffic: Traffic, predicted: dict[str, float], layout: Layout
) -> tuple[float, float, float]:
    """(measured, planned, before) TP bytes per block per step of the busiest rank; the hidden states are fp32."""
    model = LAYOUTS[name][0]
    hidden = layout.micro_batch * model["seq_len"] * model["d_model"] * 4 * 2 * (layout.tp - 1) / layout.tp
    layers = max(layout.stage_layers(model["n_layers"])) if layout.pp > 1 else model["n_layers"]
    planned = layout.grad_accum * tensor_parallel_block_reduces(layout) * hidden
    measured = (traffic.sent("tp") - (predicted["tp"] - layers * planned)) / layers
    return measured, planned, layout.grad_accum * _old_block_reduces(layout, model.get("mlp", "swiglu")) * hidden


def _fmt(nbytes: float) -> str:
    return f"{nbytes / 1e6:9.3f}" if nbytes else f"{'-':>9}"


def main() -> None:
    """Run every layout and print the two tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per layout (2 and 3 are counted)")
    parser.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    parser.add_argument("--work", default=None, help="work folder; layouts measured there before are reused")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="tdeploy-comm-"))
    data = PrepareConfig(
        output_url=str(work / "data"), builtin_corpus="python-docs", builtin_max_bytes=300_000,
        tokenizer={"kind": "bytes"}, workers=1,
    )  # fmt: skip
    dataset = prepare_dataset(data, StorageConfig(), validate=False).dataset_url
    results: dict[str, tuple[Traffic, dict[str, float], Layout]] = {}
    for name in names:
        results[name] = run_layout(work, dataset, name, args.steps)
    print("MB sent per step by the busiest rank (ring-equivalent) vs the planner's MB per GPU per step")
    print(f"{'layout':>14} {'dim':>3} {'measured':>9} {'mean':>9} {'planner':>9} {'ratio':>6}  collectives per step")
    for name, (traffic, predicted, _) in results.items():
        for dim in DIMS:
            measured, mean = traffic.sent(dim), traffic.sent(dim, "mean")
            if not measured and not predicted[dim]:
                continue
            ratio = f"{measured / predicted[dim]:6.3f}" if predicted[dim] else f"{'inf':>6}"
            ops = ", ".join(
                f"{op.split(':', 1)[1]} {n:g}" for op, n in sorted(traffic.ranks[0].ops_per_step.items())
                if op.startswith(f"{dim}:")
            )  # fmt: skip
            print(f"{name:>14} {dim:>3} {_fmt(measured)} {_fmt(mean)} {_fmt(predicted[dim])} {ratio}  {ops}")
        other = max(r.sent_per_step.get("other", 0.0) for r in traffic.ranks)
        if other:
            print(f"{name:>14} {'oth':>3} {_fmt(other)}   (groups outside the mesh: world-wide checks)")
    print()
    print(f"{'layout':>14} {'procs':>5} {'tokens/s':>9} {'vs DDP':>7}")
    for name, (traffic, _, _) in results.items():
        tps = traffic.tokens_per_s(skip=2)
        baseline = LAYOUTS[name][3]
        ref = results[baseline][0].tokens_per_s(skip=2) if baseline in results else None
        vs = f"{tps / ref:7.2f}" if ref else f"{'-':>7}"
        print(f"{name:>14} {LAYOUTS[name][2]:>5} {tps:9.0f} {vs}")
    tensor_parallel = {name: result for name, result in results.items() if result[2].tp > 1}
    if tensor_parallel:
        print()
        print("MB of TP traffic per block per step (busiest rank): measured, planned, and before regions shared inputs")
        print(f"{'layout':>14} {'measured':>9} {'planned':>9} {'ratio':>6} {'before':>9} {'now/before':>10}")
        for name, (traffic, predicted, layout) in tensor_parallel.items():
            measured, planned, before = tp_per_block(name, traffic, predicted, layout)
            print(f"{name:>14} {_fmt(measured)} {_fmt(planned)} {measured / planned:6.3f} {_fmt(before)} "
                  f"{measured / before:10.3f}")  # fmt: skip
    print(f"work folder {work}")


if __name__ == "__main__":
    main()
