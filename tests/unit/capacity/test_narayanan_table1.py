"""The planner's parameter counts and FLOPs against Narayanan et al. 2021 Table 1.

Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(arXiv 2104.04473), Table 1: ten GPT models from 1.7B to 1T parameters (attention heads, hidden size, layers,
TP and PP sizes, GPUs, global batch, achieved teraFLOP/s per GPU, percentage of the A100's 312 teraFLOP/s peak,
aggregate petaFLOP/s), with s = 2048 and V = 51,200 for all (section 5.1), and eq. 2 for the parameter count,
P = 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)).

The table's numbers are rounded: parameters to 0.1B, teraFLOP/s to integers, percentages to integers, petaFLOP/s
to 0.1. What is checked, each to its printed rounding: our count of the same GPT architecture is eq. 2 plus the
final LayerNorm's 2h, and prints as the table's billions; the table's percentage and aggregate columns follow from
its teraFLOP/s column (where the product of two rounded numbers cannot be held to the third's rounding, the bound
is the rounding of the teraFLOP/s figure, and the test says which rows need it); and our utilization of that
throughput is the table's percentage of peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tasks.capacity.compute import flops_utilization
from tasks.capacity.params import Architecture, count_params
from tests.unit.capacity.test_published_flops import megatron_gpt

A100_PEAK = 312e12  # bf16/fp16 dense, the peak the table's percentages are of (section 5)


@dataclass(frozen=True)
class Row:
    """One row of Table 1."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: int
    pct_of_peak: int
    aggregate_pflops: float

    @property
    def arch(self) -> Architecture:
        """The paper's GPT model of this row."""
        return megatron_gpt(self.hidden, self.layers, self.heads)


TABLE_1 = [
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 44, 4.4),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 44, 8.8),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 46, 18.2),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 43, 34.6),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 44, 70.8),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 45, 143.8),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 47, 227.1),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 50, 297.4),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 52, 410.2),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 52, 502.0),
]
IDS = [f"{row.billions}B" for row in TABLE_1]


def eq2(row: Row) -> float:
    """Narayanan et al. eq. 2."""
    arch = row.arch
    l, h, v, s = arch.n_layers, arch.d_model, arch.vocab_size, arch.seq_len  # noqa: E741 (the paper's letters)
    return 12 * l * h**2 * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_our_count_is_eq2_plus_the_final_norm_and_prints_as_table_1(row: Row) -> None:
    arch = row.arch
    assert (arch.vocab_size, arch.seq_len) == (51200, 2048)
    total = count_params(arch).total
    # eq. 2 counts each block's two LayerNorms (4h of its 13h) but not the final one before the output layer
    assert total - eq2(row) == pytest.approx(2 * arch.d_model)
    assert round(total / 1e9, 1) == row.billions


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_the_layout_columns_multiply_to_the_gpus_and_divide_the_model(row: Row) -> None:
    assert row.gpus % (row.tp * row.pp) == 0  # data parallel is the rest
    assert row.heads % row.tp == 0
    assert row.layers % row.pp == 0  # Table 1's stages are even (35 stages of 3 layers for 529.6B)
    assert row.batch % (row.gpus // (row.tp * row.pp)) == 0


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_percent_of_peak_is_our_utilization_of_the_achieved_throughput(row: Row) -> None:
    # one GPU achieving the row's teraFLOP/s for one second
    achieved = flops_utilization(row.tflops_per_gpu * 1e12, 1.0, 1, A100_PEAK)
    assert round(100 * achieved) == row.pct_of_peak


@pytest.mark.parametrize("row", TABLE_1, ids=IDS)
def test_aggregate_petaflops_are_the_per_gpu_figure_times_the_gpus_to_its_rounding(row: Row) -> None:
    # The teraFLOP/s column is rounded to an integer, so the product is known to +-0.5 TFLOP/s x GPUs; only the
    # 1T row's printed 502.0 needs that bound (163 x 3072 = 500.7; 502.0 / 3072 = 163.4 rounds to 163).
    product = row.tflops_per_gpu * row.gpus / 1e3
    assert abs(product - row.aggregate_pflops) <= 0.5 * row.gpus / 1e3 + 0.05
