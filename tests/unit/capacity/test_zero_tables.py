"""The planner's model states against Rajbhandari et al. 2020 (ZeRO) Tables 1 and 2.

Source: Rajbhandari, Rasley, Ruwase, He 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (arXiv 1910.02054, SC20). Section 3.1 and figure 1: mixed-precision Adam keeps 2 + 2 + K bytes per
parameter with K = 12 (the fp32 master, momentum and variance); ZeRO-DP's P_os needs 4 Psi + K Psi / Nd per device,
P_os+g 2 Psi + (2 + K) Psi / Nd and P_os+g+p (4 + K) Psi / Nd. Table 1 (section 5.4): per-device model-state memory
in GB of 7.5B, 128B and 1T models at DP degree 1, 4, 16, 64, 256 and 1024, in columns P_os, P_os+g and P_os+g+p for
each model; its DP = 1 row is the baseline. Table 2: the largest model that fits a 32 GB V100 by that analysis for
MP degree 1, 2, 4, 8, 16 on 64 to 1024 GPUs (baseline, P_os, P_os+g, P_os+g+p), and the largest measured with ZeRO-DP
(P_os) and without.

The cells were not read from the paper's PDF: they are as a third-party deep dive of arXiv v3 (13 May 2020)
transcribes both tables; every one of them also follows from the formulas above, and that
is what the tests check, so a mistyped cell fails. GB is 1e9 bytes (16 bytes x 7.5B = 120 GB).

Printed rounding, which differs between the columns: the 7.5B cells are rounded (41.25 prints as 41.3, 1.875 as
1.88), the 128B and 1T cells are cut to the digits shown (513.5 prints as 513, 2218.75 as 2218, 2054.69 as 2054,
which rounding would not give). Table 2 rounds its MP = 1 row and multiplies the rounded figures by the MP degree
for the others: 15.2B is 2 x 7.6B, where twice the exact 7.64B would print 15.3B (each row has Nd = 64).
"""

from __future__ import annotations

import math
from decimal import Decimal

import pytest

from tasks.capacity.memory import MemoryModel, Precision, StageParams, model_states
from tasks.capacity.params import Architecture, count_params
from training.layout import Layout

MIXED = Precision.of("bf16", "master-weights")  # 2 + 2 + 12 bytes per parameter, the paper's K = 12
STAGES = ("P_os", "P_os+g", "P_os+g+p")  # ZeRO stages 1, 2, 3
V100_BYTES = 32e9  # Table 2's 32 GB V100, in the paper's GB
DP_DEGREES = (1, 4, 16, 64, 256, 1024)

# Table 1: parameters -> {DP degree: (P_os, P_os+g, P_os+g+p) in GB as printed}.
TABLE_1: dict[float, dict[int, tuple[str, str, str]]] = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
           64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}  # fmt: skip
CUT = {7.5e9: False, 128e9: True, 1e12: True}  # cells cut to the digits shown rather than rounded (module doc)
CELLS = [(psi, nd, stage) for psi, rows in TABLE_1.items() for nd in rows for stage in (1, 2, 3)]


def _whole(params: float) -> StageParams:
    """`params` parameters held by one rank of an unsplit model (no tensor or pipeline parallelism)."""
    return StageParams(dense_layer=0.0, expert_layer=0.0, embed=0.0, head=0.0, dense=params, expert=0.0)


def _states_bytes(params: float, nd: int, zero: int) -> float:
    """The planner's model-state bytes per device of `params` parameters at ZeRO stage `zero` over `nd` ranks."""
    return model_states(_whole(params), MIXED, Layout(dp=nd, zero=zero)).total


def _half_unit(printed: str) -> float:
    """Half a unit of the printed figure's last digit."""
    return 0.5 * 10.0 ** Decimal(printed).as_tuple().exponent


def _prints_as(value: float, printed: str, cut: bool) -> bool:
    """Whether `value` prints as `printed`, rounded or cut to the digits `printed` shows."""
    decimals = -int(Decimal(printed).as_tuple().exponent)
    if cut:
        return math.floor(value * 10**decimals + 1e-6) == round(float(printed) * 10**decimals)
    return abs(value - float(printed)) <= _half_unit(printed) + 1e-9


def _size_id(psi: float) -> str:
    """7.5B, 128B, 1T."""
    return f"{psi / 1e12:g}T" if psi >= 1e12 else f"{psi / 1e9:g}B"


def _cell_id(cell: tuple[float, int, int]) -> str:
    psi, nd, stage = cell
    return f"{_size_id(psi)}-dp{nd}-{STAGES[stage - 1]}"


def test_mixed_precision_adam_keeps_the_papers_2_plus_2_plus_k_bytes() -> None:
    assert (MIXED.weight_bytes, MIXED.grad_bytes, MIXED.optimizer_bytes) == (2, 2, 12)


@pytest.mark.parametrize("cell", CELLS, ids=_cell_id)
def test_table1_cell_is_the_planners_model_states_per_device(cell: tuple[float, int, int]) -> None:
    psi, nd, stage = cell
    printed = TABLE_1[psi][nd][stage - 1]
    gb = _states_bytes(psi, nd, stage) / 1e9
    assert _prints_as(gb, printed, CUT[psi]), (printed, gb)


@pytest.mark.parametrize("psi", list(TABLE_1), ids=_size_id)
def test_table1_cells_follow_the_papers_formulas_for_each_stage(psi: float) -> None:
    k = 12
    for nd in DP_DEGREES:
        formulas = ((2 + 2 + k) * psi, 4 * psi + k * psi / nd, 2 * psi + (2 + k) * psi / nd, (2 + 2 + k) * psi / nd)
        for zero, expected in enumerate(formulas):
            assert _states_bytes(psi, nd, zero) == pytest.approx(expected), (nd, zero)


@pytest.mark.parametrize("psi", list(TABLE_1), ids=_size_id)
def test_the_baseline_does_not_shrink_with_data_parallelism_and_is_table1s_dp1_row(psi: float) -> None:
    # Table 1 prints no baseline column: plain data parallelism keeps all 16 Psi on every device, the DP = 1 row.
    baseline = {_states_bytes(psi, nd, 0) for nd in DP_DEGREES}
    assert baseline == {16 * psi}
    assert all(_prints_as(16 * psi / 1e9, printed, CUT[psi]) for printed in TABLE_1[psi][1])


def test_the_memory_model_of_a_7_5b_architecture_keeps_table1s_bytes_per_parameter() -> None:
    # What a plan reports, for a real architecture of 7,499,681,792 parameters (the ZeRO paper's 7.5B in
    # test_memory.py): its model states divided by its parameters are Table 1's 7.5B column divided by 7.5B.
    arch = Architecture(n_layers=32, d_model=4096, n_heads=32, ffn_hidden=12544, vocab_size=51200, seq_len=2048)
    params = count_params(arch).total
    assert params == 7_499_681_792
    model = MemoryModel(arch, MIXED)
    for nd in DP_DEGREES:
        for zero in range(4):
            per_param = model.estimate(Layout(dp=nd, zero=zero)).states.total / params
            assert per_param == pytest.approx(_states_bytes(7.5e9, nd, zero) / 7.5e9), (nd, zero)


# Table 2, theoretical columns: MP degree -> (GPUs, baseline, P_os, P_os+g, P_os+g+p) as printed.
TABLE_2: dict[int, tuple[int, str, str, str, str]] = {
    1: (64, "2B", "7.6B", "14.4B", "128B"),
    2: (128, "4B", "15.2B", "28.8B", "256B"),
    4: (256, "8B", "30.4B", "57.6B", "0.5T"),
    8: (512, "16B", "60.8B", "115.2B", "1T"),
    16: (1024, "32B", "121.6B", "230.4B", "2T"),
}
# Table 2, measured columns: MP degree -> (baseline, ZeRO-DP with P_os) as printed.
TABLE_2_MEASURED: dict[int, tuple[str, str]] = {
    1: ("1.3B", "6.2B"), 2: ("2.5B", "12.5B"), 4: ("5B", "25B"), 8: ("10B", "50B"), 16: ("20B", "100B"),
}  # fmt: skip
UNITS = {"B": 1e9, "T": 1e12}


def _parameters(printed: str) -> tuple[float, float]:
    """A printed model size as (parameters, half a unit of its last digit in parameters)."""
    number, unit = printed[:-1], UNITS[printed[-1]]
    return float(number) * unit, _half_unit(number) * unit


def _largest_model(mp: int, nd: int, zero: int) -> float:
    """The most parameters whose model states fit a 32 GB device, split over `mp` model-parallel ranks."""
    bytes_per_param = _states_bytes(1.0, nd, zero)  # per device, of the parameters that device holds
    return V100_BYTES * mp / bytes_per_param


def test_table2_rows_each_have_64_data_parallel_ranks() -> None:
    assert {gpus // mp for mp, (gpus, *_) in TABLE_2.items()} == {64}


@pytest.mark.parametrize("mp", list(TABLE_2), ids=lambda mp: f"mp{mp}")
@pytest.mark.parametrize("zero", [0, 1, 2, 3], ids=["baseline", *STAGES])
def test_table2_cell_is_the_largest_model_whose_planned_states_fit_32_gb(zero: int, mp: int) -> None:
    gpus, *printed = TABLE_2[mp]
    params, half = _parameters(printed[zero])
    _, first_half = _parameters(TABLE_2[1][1 + zero])
    # The table scales its rounded first row by MP (module doc), so a cell is known to MP x the first row's half
    # unit; the P_os+g+p cells in T are 128 MP billion rounded again (0.512T prints as 0.5T, 1.024T as 1T).
    largest = _largest_model(mp, gpus // mp, zero)
    assert abs(largest - params) <= max(half, mp * first_half) + 1.0, (printed[zero], largest)


@pytest.mark.parametrize("mp", [2, 4, 8, 16], ids=lambda mp: f"mp{mp}")
def test_table2_rows_beyond_the_first_are_its_rounded_figures_times_the_mp_degree(mp: int) -> None:
    # Baseline, P_os and P_os+g: the printed figure is MP x the first row's printed figure, not the exact value
    # rounded again (2 x 7.642B = 15.28B, printed 15.2B; 16 x 14.42B = 230.8B, printed 230.4B).
    for column in (1, 2, 3):
        first, cell = TABLE_2[1][column], TABLE_2[mp][column]
        assert Decimal(cell[:-1]) == mp * Decimal(first[:-1]), (column, cell)
    # Rounded again, the exact P_os figure would print otherwise in every such row.
    exact_p_os = _largest_model(mp, 64, 1)
    assert round(exact_p_os / 1e9, 1) != float(TABLE_2[mp][2][:-1])


@pytest.mark.parametrize("mp", list(TABLE_2), ids=lambda mp: f"mp{mp}")
def test_table2_measured_sizes_fit_within_the_planners_largest_model(mp: int) -> None:
    # Measured runs also hold activations, buffers and fragmentation (the paper's residual states), so they stop
    # short of the model-state bound: 6.2B of the 7.6B with P_os, 1.3B of the 2B without.
    gpus = TABLE_2[mp][0]
    baseline, p_os = (_parameters(printed)[0] for printed in TABLE_2_MEASURED[mp])
    assert baseline < _largest_model(mp, gpus // mp, 0)
    assert p_os < _largest_model(mp, gpus // mp, 1)
    assert _states_bytes(p_os / mp, gpus // mp, 1) < V100_BYTES
