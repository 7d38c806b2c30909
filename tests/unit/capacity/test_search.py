"""Plan search: a fitting layout where one exists, the impossible rejected with reasons, every layout counted."""

from __future__ import annotations

import re

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.memory import GIB, MemoryModel, Precision
from tasks.capacity.params import PRESETS
from tasks.capacity.search import Estimator, enumerate_layouts, explain_win, ranked, search
from tasks.capacity.units import gib
from training.layout import Layout


def _estimator(preset: str, accelerator: str, gpus_per_node: int = 8) -> Estimator:
    arch, acc = PRESETS[preset], CATALOGUE[accelerator]
    return Estimator(arch, MemoryModel(arch, Precision.of("bf16")), acc, gpus_per_node, acc.memory_bytes * 0.9, 0.4)


def test_8b_on_one_h100_node_does_not_fit_with_ddp_but_the_search_finds_layouts_that_do() -> None:
    est = _estimator("llama-3.1-8b", "h100-sxm")
    ddp = est.evaluate(Layout(dp=8, micro_batch=1, grad_accum=8))
    assert not ddp.fits
    assert ddp.why_not().startswith(f"needs {gib(ddp.memory.total)} GiB > 71.68 GiB usable")
    result = search(est, enumerate_layouts(est.arch, 8, 8, global_batch=64))
    assert result.fitting and result.fitting_count > 10
    best = result.fitting[0]
    assert best.fits and best.memory.total <= 0.9 * 79.65 * GIB
    assert all(a.step_seconds <= b.step_seconds for a, b in zip(result.fitting, result.fitting[1:], strict=False))
    assert any("to spare" in reason for reason in explain_win(best, result.fitting[1]))


def test_70b_on_a_single_l40s_is_rejected_with_what_it_needs() -> None:
    est = _estimator("llama-3.1-70b", "l40s", gpus_per_node=1)
    result = search(est, enumerate_layouts(est.arch, 1, 1, global_batch=8))
    assert result.fitting == [] and result.evaluated > 0
    nearest = result.rejected[0]
    assert nearest.why_not().startswith("needs ") and "GiB usable" in nearest.why_not()


def test_layouts_respect_divisibility_and_keep_the_global_batch() -> None:
    arch = PRESETS["llama-3.1-8b"]  # 32 heads, 8 kv heads, 32 layers
    layouts = list(enumerate_layouts(arch, world=16, gpus_per_node=8, global_batch=32))
    assert layouts
    for lo in layouts:
        assert lo.world == 16 and lo.global_batch == 32
        assert 8 % lo.tp == 0 and arch.kv_heads % lo.tp == 0 and arch.n_layers % lo.pp == 0
        assert lo.pp == 1 or lo.grad_accum >= lo.pp


def test_search_over_ten_thousand_layouts_evaluates_and_counts_every_one() -> None:
    # How fast it goes is the benchmark's business: benchmarks/capacity_accuracy.py prints the search time.
    est = _estimator("gpt3-175b", "a100-80gb")
    layouts = list(enumerate_layouts(est.arch, 768, 8, global_batch=1536))
    assert len(layouts) >= 10_000 and len(set(layouts)) == len(layouts)
    result = search(est, iter(layouts), top=5)
    assert result.evaluated == len(layouts)
    assert 5 <= result.fitting_count <= len(layouts) and len(result.fitting) == 5
    assert all(ev.fits for ev in result.fitting) and not any(ev.fits for ev in result.rejected)


def test_the_pruned_search_finds_the_same_fastest_layouts_and_nearest_misses_as_evaluating_every_one() -> None:
    # The search skips the full timing of a fitting layout whose matmuls alone are slower than the `top` found so
    # far, the memory of a layout whose model states alone do not fit, and a pipeline's last stage once its first
    # is over the limit; none of that may change what it reports.
    est = _estimator("gpt3-175b", "a100-80gb")
    layouts = list(enumerate_layouts(est.arch, 768, 8, global_batch=1536, context_parallel=True))[::7]
    every = [est.evaluate(lo) for lo in layouts]
    fits = sorted(
        (ev for ev in every if ev.fits),
        key=lambda e: (round(e.step_seconds, 9), e.comm.total_seconds, -e.layout.micro_batch, e.memory.total),
    )
    misses = sorted((ev for ev in every if not ev.fits), key=lambda e: e.memory.total)  # stable: enumeration order
    result = search(est, iter(layouts), top=20, keep_rejected=7)
    assert result.fitting_count == len(fits) and result.evaluated == len(layouts)
    assert [ev.layout for ev in result.fitting] == [ev.layout for ev in fits[:20]]
    assert [ev.layout for ev in result.rejected] == [ev.layout for ev in misses[:7]]
    assert [ev.memory.total for ev in result.rejected] == [ev.memory.total for ev in misses[:7]]


GIB_FIGURE = re.compile(r"^\d{1,3}(,\d{3})*\.\d{2}$")


def _three_significant_digits(figure: str) -> bool:
    digits = figure.lstrip("-").replace(",", "").replace(".", "").lstrip("0")
    return "e" not in figure and (figure == "0" or len(digits) == 3)


def test_why_and_why_not_cells_write_gib_with_two_decimals_and_seconds_to_three_significant_digits() -> None:
    est = _estimator("llama-3.1-70b", "h100-sxm")
    result = search(est, enumerate_layouts(est.arch, 64, 8, global_batch=128), top=20)
    reasons = [r for ev, nxt in ranked(result.fitting) for r in explain_win(ev, nxt)]
    reasons += [ev.why_not() for ev in result.rejected]
    assert any("pipeline bubble" in r for r in reasons) and any("tensor-parallel traffic" in r for r in reasons)
    assert any("per step faster" in r for r in reasons) and any(r.startswith("needs ") for r in reasons)
    gib_figures = [m for r in reasons for m in re.findall(r"(\S+) GiB", r)]
    second_figures = [m for r in reasons for m in re.findall(r"(\S+) s\b", r)]
    assert gib_figures and all(GIB_FIGURE.match(f) for f in gib_figures), gib_figures
    assert second_figures and all(_three_significant_digits(f) for f in second_figures), second_figures
