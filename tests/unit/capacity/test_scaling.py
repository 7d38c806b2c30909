"""Compute-optimal sizes against Hoffmann et al. 2022 (Chinchilla): Table 3, Table A3, eq. 4 and eq. 10.

Numbers quoted from the paper (arXiv 2203.15556): Table 3 (Approach 1 projections), Table A3 (Approach 3
projections), Table 2 (exponents), figure 4's caption ("We project the optimal model size given the Gopher compute
budget to be 40B parameters") and section 4 (Chinchilla: 70B parameters, 1.4T tokens, Gopher's budget). The
published figures are rounded: parameters to round sizes, tokens to 0.1 of their unit, FLOPs to 3 digits.
"""

from __future__ import annotations

import math

import pytest

from tasks.capacity.scaling import CHINCHILLA_FIT, ComputeOptimal, ParametricLoss, tokens_per_param_optimal

# Table 3: (parameters, FLOPs, tokens, half a unit of the tokens' last printed digit).
TABLE_3 = [
    (400e6, 1.92e19, 8.0e9, 0.05e9),
    (1e9, 1.21e20, 20.2e9, 0.05e9),
    (10e9, 1.23e22, 205.1e9, 0.05e9),
    (67e9, 5.76e23, 1.5e12, 0.05e12),
    (175e9, 3.85e24, 3.7e12, 0.05e12),
    (280e9, 9.90e24, 5.9e12, 0.05e12),
    (520e9, 3.43e25, 11.0e12, 0.05e12),
    (1e12, 1.27e26, 21.2e12, 0.05e12),
    (10e12, 1.30e28, 216.2e12, 0.05e12),
]
GOPHER_FLOPS = 5.76e23  # Table 3: the 67B row is "1" in Gopher units


def test_table3_flops_are_six_n_d_of_its_parameters_and_tokens_to_the_printed_rounding() -> None:
    for params, flops, tokens, half_unit in TABLE_3:
        lo = ComputeOptimal(params, tokens - half_unit).flops
        hi = ComputeOptimal(params, tokens + half_unit).flops
        if params == 67e9:
            # The Gopher-budget row is not consistent to its rounding: 5.76e23 / (6 x 67B) is 1.43T tokens, printed
            # as 1.5T, so 6ND of the printed figures is 6.03e23, 4.7% above the printed FLOPs.
            assert ComputeOptimal(params, tokens).flops == pytest.approx(flops, rel=0.05)
            continue
        flops_half_unit = 0.005 * 10 ** math.floor(math.log10(flops))  # 3 printed digits
        assert lo <= flops + flops_half_unit and flops - flops_half_unit <= hi, (params, lo, flops, hi)


def test_twenty_tokens_per_parameter_reproduces_table3_to_a_few_percent() -> None:
    # Table 3 is Approach 1's fit, whose tokens per parameter drift from 20.0 (400M) to 21.6 (10T): the rule of
    # thumb matches it to 5% on parameters and 4% on tokens, not to the printed rounding. The 67B row is 7.6% off
    # on tokens because its printed 1.5T is rounded up (previous test).
    for params, flops, tokens, _ in TABLE_3:
        opt = tokens_per_param_optimal(flops)
        assert opt.flops == pytest.approx(flops)
        assert opt.tokens_per_param == pytest.approx(20.0)
        assert opt.params == pytest.approx(params, rel=0.05)
        assert opt.tokens == pytest.approx(tokens, rel=0.08 if params == 67e9 else 0.04)
    # N_opt ∝ C^0.5: a hundred times the budget, ten times the model.
    assert tokens_per_param_optimal(100 * GOPHER_FLOPS).params == pytest.approx(
        10 * tokens_per_param_optimal(GOPHER_FLOPS).params
    )


def test_parametric_fit_exponents_are_table2s_approach3() -> None:
    # Table 2 gives a = 0.46, b = 0.54 from the unrounded fit; eq. 10's printed alpha = 0.34, beta = 0.28 give
    # 0.452 and 0.548.
    assert CHINCHILLA_FIT.params_exponent == pytest.approx(0.46, abs=0.01)
    assert CHINCHILLA_FIT.tokens_exponent == pytest.approx(0.54, abs=0.01)
    assert CHINCHILLA_FIT.loss(70e9, 1.4e12) == pytest.approx(1.69 + 406.4 / 70e9**0.34 + 410.7 / 1.4e12**0.28)


def test_parametric_optimum_minimises_the_fitted_loss_on_its_isoflop_line() -> None:
    for flops in (1e20, GOPHER_FLOPS, 1e26):
        opt = CHINCHILLA_FIT.optimal(flops)
        assert opt.flops == pytest.approx(flops)
        best = CHINCHILLA_FIT.loss(opt.params, opt.tokens)
        for factor in (0.8, 0.95, 1.05, 1.25):
            n = opt.params * factor
            assert CHINCHILLA_FIT.loss(n, flops / (6 * n)) > best


def test_parametric_fit_puts_gophers_budget_optimum_below_chinchillas_70b_as_the_paper_says() -> None:
    opt = CHINCHILLA_FIT.optimal(GOPHER_FLOPS)
    # Section 4: the optimum for Gopher's budget is "between 40 and 70 billion"; Chinchilla took the larger end,
    # 70B on 1.4T tokens. Approach 3 is the smaller end: figure 4 says 40B. The printed, rounded constants give
    # 32B (and 3.0T tokens), so the magnitude is checked to 25%.
    assert opt.params < 70e9 and opt.tokens > 1.4e12
    assert opt.params == pytest.approx(40e9, rel=0.25)
    # Section 3.4: the third approach predicts smaller models than the other two, more so at larger budgets.
    rule = tokens_per_param_optimal
    assert opt.params < rule(GOPHER_FLOPS).params
    ratio = [CHINCHILLA_FIT.optimal(c).params / rule(c).params for c in (1e21, GOPHER_FLOPS, 1e26)]
    assert ratio[0] > ratio[1] > ratio[2]


def test_parametric_fit_with_printed_constants_predicts_smaller_models_than_table_a3() -> None:
    # Table A3 (Approach 3): (parameters, FLOPs). Its 175B row prints 1.26e+24 FLOPs for 12.0T tokens (6ND is
    # 1.26e25), so it is left out. Eq. 4 with eq. 10's rounded constants lands 18-30% below every row: the same
    # direction as at Gopher's budget, by less than a third.
    table_a3 = [(400e6, 2.21e19), (1e9, 1.62e20), (10e9, 2.46e22), (67e9, 1.71e24), (280e9, 3.52e25)]
    table_a3 += [(520e9, 1.36e26), (1e12, 5.65e26), (10e12, 8.55e28)]
    for params, flops in table_a3:
        predicted = CHINCHILLA_FIT.optimal(flops).params
        assert params * 2 / 3 < predicted < params, (params, predicted)


def test_a_different_fit_moves_the_optimum_the_way_its_exponents_say() -> None:
    # Equal exponents and coefficients split the budget evenly: N_opt = D_opt = sqrt(C / 6).
    even = ParametricLoss(e=1.0, a=400.0, b=400.0, alpha=0.3, beta=0.3)
    opt = even.optimal(6e22)
    assert opt.params == pytest.approx(1e11) and opt.tokens == pytest.approx(1e11)
