"""plan.json has one owner: write_plan writes it, read_plan reads it back typed, and a bad file is named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.capacity.plan import CapacityPlan, plan_capacity, write_plan
from tasks.capacity.record import UnreadablePlan, read_plan
from tasks.diagnose import diagnose
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

# Eight ranks of a model whose memory depends on the layout: the requested DDP layout does not fit 2 GiB devices.
TIGHT = {
    "cluster": {"procs_per_node": 8, "accelerator": "small-gpu"},
    "model": {"n_layers": 8, "d_model": 512, "n_heads": 8, "n_kv_heads": 8, "ffn_hidden": 1376, "vocab_size": 32000},
    "parallel": {"micro_batch": 8},
    "precision": {"dtype": "bf16"},
    "capacity": {
        "enforce": False,
        "accelerators": {
            "small-gpu": {
                "kind": "gpu", "memory_gib": 2, "peak_tflops_bf16": 100, "peak_tflops_fp16": 100,
                "peak_tflops_fp32": 10, "hbm_tb_s": 1, "intra_node_gb_s": 100, "inter_node_gb_s": 10,
            }
        },
    },
}  # fmt: skip


def _plan(overrides: dict) -> CapacityPlan:
    s = parse_spec(deep_merge(TINY_SPEC, overrides))
    return plan_capacity(s.name, s.capacity, s.cluster, s.model, s.parallel, s.precision, s.run)


def test_read_plan_gives_back_what_write_plan_wrote(tmp_path: Path) -> None:
    plan = _plan(TIGHT)
    url = write_plan(plan, str(tmp_path))
    record = read_plan(url)
    assert record.name == plan.name and record.fits == plan.fits
    assert record.requested.name == plan.requested.layout.describe()
    assert record.requested.peak_bytes == plan.requested.memory.total
    assert record.requested.usable_bytes == plan.requested.usable_bytes
    assert record.requested.step_seconds == plan.requested.step_seconds
    assert record.fitting() == [ev.layout.describe() for ev in plan.search.fitting] != []
    assert record.search.evaluated_layouts == plan.search.evaluated
    assert record.raw["requested"]["layout"]["world"] == plan.requested.layout.world  # every figure is kept


def test_a_plan_that_does_not_fit_reaches_the_diagnosis_through_the_reader(tmp_path: Path) -> None:
    plan = _plan(TIGHT)
    assert not plan.fits
    record = read_plan(write_plan(plan, str(tmp_path)))
    [finding] = [f for f in diagnose("CUDA out of memory", "", None, record).findings if f.cause == "out of memory"]
    assert f"capacity plan: {plan.requested.layout.describe()} needs" in " ".join(finding.evidence)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "no such file"),
        ('{"name": "x", "fits": tr', "not JSON"),
        ('{"name": "x", "fits": true}', "requested: Field required"),
    ],
)
def test_a_bad_plan_file_is_named_with_what_is_wrong(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(UnreadablePlan, match="not a capacity plan") as caught:
        read_plan(str(path))
    assert str(path) in str(caught.value) and problem in caught.value.problem
