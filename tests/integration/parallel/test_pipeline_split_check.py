"""A pipeline split that leaves a layer out fails connectivity, naming the layer: the ranks record the layers they
run (ranks.json mesh `layers`) and acceptance checks each runs on exactly one stage. The bad split is applied to
the job through the test harness (tests/faults/harness/sitecustomize.py), the trainer itself unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.local import run_local
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge
from tests.integration.parallel.model_parallel_faults import patched
from training.run_output import RunOutput
from validation.acceptance import check_connectivity

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.mark.parametrize("dropped", [False, True], ids=["clean", "layer-2-dropped"])
def test_a_pipeline_split_that_skips_a_layer_fails_connectivity_naming_it(
    dropped: bool, tiny_dataset: str, tmp_path: Path
) -> None:
    patch = patched("pipeline_drops_a_layer") if dropped else {}
    spec = parse_spec(deep_merge(TINY_SPEC, {
        "cluster": {"procs_per_node": 2},
        "model": {"n_layers": 4},
        "parallel": {"pipeline_parallel": 2, "micro_batch": 2, "grad_accum_steps": 2},
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(tmp_path / "checkpoints"), "save_every_steps": None},
        "run": {"output_url": str(tmp_path / "output"), "steps": 2},
    }), "tiny:pipeline-split")  # fmt: skip
    # The harness's variables are set past the spec (which reserves PYTHONPATH): a test's job only.
    cluster = spec.cluster.model_copy(update={"env": {**spec.cluster.env, **patch}})
    job = run_local(cluster, spec.training_config())
    meshes = {r["rank"]: r["mesh"] for r in RunOutput(job.output_dir).ranks().ranks}
    result = check_connectivity(Path(job.output_dir), 2)
    if not dropped:
        assert [meshes[0]["layers"], meshes[1]["layers"]] == [[0, 1], [2, 3]]
        assert result.passed, result.message
        return
    assert [meshes[0]["layers"], meshes[1]["layers"]] == [[0, 1], [3]]  # the trainer ran without layer 2
    assert not result.passed
    assert "the pipeline split is wrong: layer 2 of 4 run(s) on no pipeline stage" in result.message, result.message
    assert "stage 0: layers 0, 1 | stage 1: layer 3" in result.message
