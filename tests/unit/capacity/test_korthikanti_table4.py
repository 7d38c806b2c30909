"""The planner's time per layer against Korthikanti et al. 2022 Table 4 (recompute and sequence parallelism).

Source: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198),
Table 4: forward, backward and combined time of one transformer layer of the 22B model, and the overhead over the
baseline, for the baseline (no recompute), sequence parallelism, full recompute ("baseline with recompute"),
selective recompute, and selective recompute with sequence parallelism; section 6.2 explains it. The 22B model is
Table 3's: 64 heads, h = 6144, 48 layers, tensor parallel 8, one node of 8 A100 80GB, global and micro batch 4;
s = 2048, v = 51200, mixed precision (section 6). Read from a third-party full-text transcription of the paper;
three other public notes quote the same five rows.

Table 4 is a measurement of Megatron-LM's kernels, so it is compared with the planner's time model (matmuls at the
spec's default 40% of peak, memory-bound kernels at 80% of the memory bandwidth, tensor-parallel all-reduces, as
the search evaluates a layout; attention "math", the score matrices Megatron's fused softmax keeps) where the two
agree, and within a stated tolerance:

- Full recompute adds one forward pass. In the planner it adds a third to the matmuls and memory-bound kernels of
  a layer and a quarter to its all-reduces (torch's checkpoint stops replaying before the MLP's), 33% in all (the
  paper's "expected 33%"); measured, the backward grows by 7.6 ms for a 7.7 ms forward, and the 39% follows from
  Megatron's backward being only 1.55x its forward (it overlaps its all-reduces with the weight-gradient GEMMs),
  not 2x.
- Selective recompute adds the attention core: the planner's overhead (eq. 8's FLOPs and the recomputed softmax and
  dropout bytes) is 6.1%, the table's 20.9 / 19.6 is 6.6% (printed 7%; its rounding alone spans 6.1% to 7.2%).
- Sequence parallelism leaves the matmuls alone and saves time, and its saving adds to selective recompute's.

Not checked, because the planner disagrees: how much sequence parallelism saves. Table 4 measures 3% (0.5 ms of
the forward); the planner's layer is 8% shorter, and selective + sequence 1% shorter than the baseline where
Table 4 measures 4% longer. The planner times its own payload (Megatron's 4 all-reduces per layer with and without
sequence parallelism), whose norm, two residual adds and two dropouts are separate kernels (184 kB per token of a
22B layer's forward, split 8 ways by sequence parallelism; Megatron fuses bias, dropout and add).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.config import CapacityConfig
from tasks.capacity.memory import MemoryModel, Precision, Runtime
from tasks.capacity.search import Estimator
from tasks.capacity.timing import StepTime
from training.layout import Layout, Recompute
from tests.unit.capacity.test_published_flops import megatron_gpt

MS_HALF_UNIT = 0.05  # Table 4 prints milliseconds to 0.1
TP, MICRO_BATCH = 8, 4  # Table 3's 22B row
TERMS = ("matmul", "memory_bound", "tensor_parallel")


@dataclass(frozen=True)
class Row:
    """One row of Table 4: milliseconds per layer and the printed overhead in percent."""

    experiment: str
    recompute: Recompute
    sequence_parallel: bool
    forward_ms: float
    backward_ms: float
    combined_ms: float
    overhead_pct: int | None


TABLE_4 = {
    row.experiment: row
    for row in (
        Row("Baseline no recompute", "none", False, 7.7, 11.9, 19.6, None),
        Row("Sequence Parallelism", "none", True, 7.2, 11.8, 19.0, -3),
        Row("Baseline with recompute", "full", False, 7.7, 19.5, 27.2, 39),
        Row("Selective Recompute", "selective", False, 7.7, 13.2, 20.9, 7),
        Row("Selective + Sequence", "selective", True, 7.2, 13.1, 20.3, 4),
    )
}
BASELINE, SEQUENCE, FULL, SELECTIVE, BOTH = TABLE_4.values()


def _step(layers: int, row: Row) -> StepTime:
    """The planner's step of a 22B-shaped model with `layers` layers in `row`'s configuration, on one node."""
    arch = megatron_gpt(6144, layers, 64)
    defaults = CapacityConfig.model_fields
    estimator = Estimator(
        arch=arch,
        memory=MemoryModel(arch, Precision.of("bf16", "master-weights"), Runtime(attention="math")),
        accelerator=CATALOGUE["a100-80gb"],
        gpus_per_node=8,
        usable_bytes=CATALOGUE["a100-80gb"].memory_bytes,
        efficiency=defaults["mfu"].default,
        bandwidth_efficiency=defaults["memory_bandwidth_efficiency"].default,
    )
    layout = Layout(
        dp=1, tp=TP, micro_batch=MICRO_BATCH, recompute=row.recompute, sequence_parallel=row.sequence_parallel
    )
    return estimator.evaluate(layout).time


def _layer(row: Row) -> dict[str, float]:
    """The planner's seconds of one more layer, by term and in all (`total`): 48 layers less 47."""
    with_it, without = _step(48, row), _step(47, row)
    times = {term: getattr(with_it, term) - getattr(without, term) for term in TERMS}
    times["total"] = with_it.total - without.total
    return times


@pytest.mark.parametrize("row", TABLE_4.values(), ids=list(TABLE_4))
def test_table4_combined_is_forward_plus_backward_and_overhead_is_over_the_baseline(row: Row) -> None:
    assert row.forward_ms + row.backward_ms == pytest.approx(row.combined_ms)
    if row.overhead_pct is not None:
        assert round(100 * (row.combined_ms / BASELINE.combined_ms - 1)) == row.overhead_pct


def test_full_recompute_adds_one_forward_to_the_planners_layer_and_the_attentions_all_reduce() -> None:
    # Backward is twice the forward in FLOPs and bytes, so the forward again is a third of the layer; of the
    # forward's two all-reduces torch's checkpoint replays the attention's only (it stops once the tensors the
    # backward saved are back), one more to the layer's four.
    none, full = _layer(BASELINE), _layer(FULL)
    growth = {"matmul": 4 / 3, "memory_bound": 4 / 3, "tensor_parallel": 5 / 4}
    for term in TERMS:
        assert full[term] == pytest.approx(none[term] * growth[term], rel=1e-6), term
    assert round(100 * (full["total"] / none["total"] - 1)) == 33  # section 6.2: "as opposed to the expected 33%"


def test_table4s_full_recompute_costs_one_measured_forward_pass() -> None:
    # The backward grows by 7.6 ms for a 7.7 ms forward: one forward, to the rounding of three printed figures.
    recompute_ms = FULL.backward_ms - BASELINE.backward_ms
    assert abs(recompute_ms - BASELINE.forward_ms) <= 3 * MS_HALF_UNIT
    # Adding one forward to the measured split gives the printed 39%, not 33%: Megatron's backward is 1.55x its
    # forward, because it overlaps its tensor-parallel all-reduces with the weight-gradient GEMMs (section 6.2).
    one_forward_more = BASELINE.forward_ms / BASELINE.combined_ms
    assert round(100 * one_forward_more) == FULL.overhead_pct
    assert BASELINE.backward_ms / BASELINE.forward_ms == pytest.approx(1.55, abs=0.01)


def test_selective_recompute_overhead_of_the_planners_layer_is_table4s_within_a_point() -> None:
    # Printed 20.9 / 19.6 ms is 6.6% (6.1% to 7.2% by their rounding); the planner's 6.1% counts eq. 8's FLOPs at
    # 40% of peak and the softmax and dropout bytes at 80% of the bandwidth, not Megatron's fused kernels.
    measured = SELECTIVE.combined_ms / BASELINE.combined_ms - 1
    planned = _layer(SELECTIVE)["total"] / _layer(BASELINE)["total"] - 1
    assert planned == pytest.approx(measured, abs=0.01)


def test_sequence_parallelism_shortens_a_layer_without_touching_its_matmuls_in_the_planner_and_in_table4() -> None:
    # Section 6.2: the layer-norm and dropout run on 1/t of the data; the 0.5 ms comes off the forward.
    assert SEQUENCE.forward_ms < BASELINE.forward_ms and SEQUENCE.combined_ms < BASELINE.combined_ms
    none, sp = _layer(BASELINE), _layer(SEQUENCE)
    assert sp["matmul"] == pytest.approx(none["matmul"])
    assert sp["memory_bound"] < none["memory_bound"]
    assert sp["total"] < none["total"]


def test_gains_of_sequence_parallelism_and_selective_recompute_add_up_in_the_planner_as_in_table4() -> None:
    # Table 4: selective + sequence is as much below selective as sequence parallelism is below the baseline
    # (0.6 ms each), to the rounding of four printed figures.
    measured = (BOTH.combined_ms - SELECTIVE.combined_ms) - (SEQUENCE.combined_ms - BASELINE.combined_ms)
    assert abs(measured) <= 4 * MS_HALF_UNIT
    layer = {row.experiment: _layer(row)["total"] for row in (BASELINE, SEQUENCE, SELECTIVE, BOTH)}
    planned_gain_with_selective = layer[BOTH.experiment] - layer[SELECTIVE.experiment]
    planned_gain = layer[SEQUENCE.experiment] - layer[BASELINE.experiment]
    assert planned_gain_with_selective == pytest.approx(planned_gain, rel=1e-3)
