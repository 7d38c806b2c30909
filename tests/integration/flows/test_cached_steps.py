"""The flow's cached steps (plan, data) on a real Prefect server: a cached result is reused only in the folder it
was made in and while the files it points at are whole; otherwise the step runs again and writes them."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def _states(flow_state) -> dict[str, str]:  # noqa: ANN001
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
            )

    return {r.name.rsplit("-", 1)[0]: r.state.name for r in asyncio.run(read())}


def test_a_cached_plan_and_dataset_are_remade_when_their_folder_is_gone_or_another_folder_runs_them(
    prefect_harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import flow

    from flows.deploy import data_step, plan_step
    from tasks.capacity.step import CapacityInputs
    from tasks.prepare.config import DataSpec, PrepareConfig
    from tasks.prepare.step import DataInputs
    from tests.conftest import TINY_SPEC, deep_merge
    from training.storage import StorageConfig
    from tasks.spec import parse_spec

    # Relative locations, as examples/local.yaml has them: runs/<name>/... under the folder tdeploy runs in.
    raw = deep_merge(TINY_SPEC, {"name": "cached", "data": {"dataset_url": "runs/cached/unused"}})
    for key in ("checkpoint", "run"):
        raw[key].pop("url", None), raw[key].pop("output_url", None)
    spec = parse_spec(raw, "cached")
    prepare = PrepareConfig(
        output_url="runs/cached/datasets",
        builtin_corpus="python-docs",
        builtin_max_bytes=120_000,
        tokenizer={"kind": "bytes"},
        workers=1,
    )

    @flow
    def pure_steps() -> tuple:
        data = DataInputs(
            data=DataSpec(prepare=prepare), vocab_size=spec.model.vocab_size, storage=StorageConfig(),
            reports_dir=spec.reports_dir,
        )  # fmt: skip
        return plan_step(CapacityInputs.of(spec)), data_step(data)

    first_folder, second_folder = tmp_path / "a", tmp_path / "b"
    first_folder.mkdir(), second_folder.mkdir()
    monkeypatch.chdir(first_folder)

    def run_here() -> tuple[dict[str, str], Path, Path]:
        state = pure_steps(return_state=True)
        plan, data = state.result()
        return _states(state), Path(plan.plan_url).resolve(), Path(data.dataset_url).resolve()

    states, plan, dataset = run_here()
    assert states == {"estimate_capacity": "Completed", "prepare_data": "Completed"}
    assert plan.is_file() and (dataset / "manifest.json").is_file()

    states, _, _ = run_here()  # whole and in the same folder: both hits
    assert states == {"estimate_capacity": "Cached", "prepare_data": "Cached"}

    shutil.rmtree(first_folder / "runs")  # the files are gone, the cached records are not
    states, plan, dataset = run_here()
    assert states == {"estimate_capacity": "Completed", "prepare_data": "Completed"}, states
    assert plan.is_file() and (dataset / "manifest.json").is_file()

    shard = next((dataset / "train").glob("*.bin"))
    shard.write_bytes(shard.read_bytes()[:-8])  # a truncated shard: the hit is void, the step itself refuses it
    state = pure_steps(return_state=True)
    states = _states(state)
    assert state.is_failed() and states == {"estimate_capacity": "Cached", "prepare_data": "Failed"}, states
    assert f"{shard.relative_to(dataset)} has " in str(state.message) and "truncated" in str(state.message)

    monkeypatch.chdir(second_folder)  # the same spec from another folder writes there
    states, plan, dataset = run_here()
    assert states == {"estimate_capacity": "Completed", "prepare_data": "Completed"}, states
    assert plan.is_relative_to(second_folder) and (dataset / "manifest.json").is_file()
    assert dataset.is_relative_to(second_folder)
