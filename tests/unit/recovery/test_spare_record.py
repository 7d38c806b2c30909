"""The trainer's record of a hot-spare takeover: which agents left and joined between two rounds of one job."""

from __future__ import annotations

from pathlib import Path

import pytest

from training.recovery_record import recovery_events
from training.run_output import RESULT, Ranks, RunOutputWriter
from training.spares import job_finished_since, previous_ranks, record_takeover, takeover
from training.storage import StorageConfig


def _ranks(*agents: str) -> list[dict[str, object]]:
    return [{"rank": rank, "agent": agent, "node": rank} for rank, agent in enumerate(agents)]


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        (("a:1", "b:2"), ("a:1", "c:3"), {"node 1": "spare c:3 in place of b:2"}),
        (("a:1", "b:2"), ("a:1", "b:2"), {}),  # a worker restart on the same agents: no spare involved
        (("a:1", "b:2"), ("c:3", "d:4"), {}),  # every agent new: a relaunch, not a takeover
        (("a:1", "b:2", "c:3"), ("a:1", "c:3"), {}),  # a node lost and none joined: elastic shrink
        ((), ("a:1", "b:2"), {}),  # the first start
    ],
    ids=["spare-joined", "same-agents", "relaunch", "shrunk", "first-start"],
)
def test_a_takeover_is_an_agent_replaced_while_others_stay(
    before: tuple[str, ...], after: tuple[str, ...], expected: dict[str, str]
) -> None:
    assert takeover(_ranks(*before), _ranks(*after)) == expected


def test_ranks_written_before_agents_were_recorded_report_no_takeover() -> None:
    assert takeover([{"rank": 0, "host": "a"}, {"rank": 1, "host": "b"}], _ranks("a:1", "c:3")) == {}


def test_the_takeover_is_appended_to_recovery_jsonl_with_the_spare_rung(tmp_path: Path) -> None:
    RunOutputWriter(str(tmp_path), StorageConfig()).write_ranks(Ranks(2, _ranks("a:1", "b:2")))
    previous = previous_ranks(str(tmp_path), None)
    assert record_takeover(str(tmp_path), None, previous, _ranks("a:1", "b:2"), 4) is None
    event = record_takeover(str(tmp_path), None, previous, _ranks("a:1", "c:3"), 4)
    assert event is not None
    (read,) = recovery_events(str(tmp_path))
    assert read.rung == "spare" and read.restored_step == 4 and read.world_size == 2
    assert read.source == {"node 1": "spare c:3 in place of b:2"}


def test_a_standby_whose_store_went_away_is_done_only_when_the_job_wrote_its_result_since(
    make_spec, tmp_path: Path
) -> None:
    train = make_spec().training_config()
    config = tmp_path / "run.json"
    train.to_json_file(config)
    assert not job_finished_since(str(config), 0.0)  # no result: the store went away with a failed job
    out = Path(train.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT).write_text("{}")  # what the trainer writes at the end of its last step
    written = (out / RESULT).stat().st_mtime
    assert job_finished_since(str(config), written - 1)
    assert not job_finished_since(str(config), written + 1)  # an earlier job's result
    assert not job_finished_since(None, 0.0)
