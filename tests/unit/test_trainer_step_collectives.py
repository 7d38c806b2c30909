"""A step on a world of one issues no collective: its loss is the rank's own, recorded as before."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from training.train import Trainer


def test_a_step_on_one_rank_issues_no_collective_and_records_its_own_loss(
    make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer = Trainer(make_spec({"run": {"steps": 2}}).training_config())
    collectives: list[str] = []
    all_reduce = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        collectives.append("all_reduce")
        return all_reduce(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    try:
        assert dist.get_world_size() == 1
        trainer._pending.append(trainer.train_step())
        [record] = trainer.flush_metrics()
    finally:
        trainer.telemetry.close()
        trainer.out.close()
        dist.destroy_process_group()

    assert collectives == []
    assert record.step == 1 and record.loss == record.rank_loss
    assert record.compute_s > 0 and record.step_time_s >= record.compute_s + record.data_wait_s
