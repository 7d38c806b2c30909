"""Weighted blends of two sources on real 2-rank runs: proportions per epoch, coverage and disjointness per
source across a resume, and the adoption of the blend by the data step."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tasks.acceptance.workspace import Job, variant
from tasks.prepare.existing import check_dataset_url
from tasks.spec import DeploymentSpec
from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo, read_manifest
from training.run_output import RunOutput
from training.sampler import Blend
from validation.data_consistency import Sampling, check_data_consistency

pytestmark = pytest.mark.integration

SEQ = 32


def _source(url: str, samples: int, letter: int) -> None:
    """A dataset of `samples` training samples of 32 + 1 tokens, every id of one letter band (to tell sources
    apart in the batches), and a small validation split."""
    rng = np.random.default_rng(letter)
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256) as writer:
        writer.add_document("train", rng.integers(letter, letter + 10, size=samples * SEQ))
        for _ in range(4):
            writer.add_document("val", rng.integers(letter, letter + 10, size=80))
    assert len(TokenDataset(url, "train", SEQ)) == samples


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Source A of 60 samples (ids 97..106), source B of 30 (ids 65..74)."""
    root = tmp_path_factory.mktemp("blend-sources")
    a, b = str(root / "a"), str(root / "b")
    _source(a, 60, 97)
    _source(b, 30, 65)
    return a, b


def _adopted(spec: DeploymentSpec, root: Path) -> tuple[str, list[str]]:
    checked = check_dataset_url(spec.data, spec.model.vocab_size, spec.storage, str(root / "reports"))
    assert checked.validation["success"], checked.validation
    return checked.dataset_url, checked.sources


def test_a_megatron_style_weight_list_is_adopted_as_one_blended_manifest(
    make_spec: Callable[..., DeploymentSpec], two_sources: tuple[str, str], tmp_path: Path
) -> None:
    a, b = two_sources
    spec = make_spec({"data": {"dataset_url": [0.3, a, 0.7, b]}})
    url, sources = _adopted(spec, tmp_path)
    assert sources == [a, b]
    manifest = read_manifest(url, trusted=sources)
    assert [(s.url, s.weight) for s in manifest.blend] == [(a, 0.3), (b, 0.7)]
    assert [s.source for s in manifest.splits["train"].shards] == [0, 1]
    assert TokenDataset(url, "train", SEQ, trusted=sources).source_samples == [60, 30]
    # the adopted manifest names files outside its folder: without the spec's sources it is refused
    with pytest.raises(Exception, match=r"prefix=.*is an absolute path"):
        read_manifest(url)
    again, _ = _adopted(spec, tmp_path)
    assert again == url  # the identical adoption is reused


def test_a_blend_keeps_its_proportions_and_per_source_coverage_across_a_resume(
    make_spec: Callable[..., DeploymentSpec], two_sources: tuple[str, str], tmp_path: Path
) -> None:
    a, b = two_sources
    spec = make_spec({"data": {"dataset_url": [0.3, a, 0.7, b]}})
    url, sources = _adopted(spec, tmp_path)
    base = spec.training_config(url, None, sources)
    # 90 draws per epoch (27 from A, 63 from B: B's 30 samples are drawn about twice), 8 per step: 11 steps.
    first = variant(base, tmp_path, "blend", run={"steps": 26, "stop_after_steps": 12},
                    checkpoint={"save_every_steps": 6, "save_at_end": True, "async_save": False})  # fmt: skip
    outcome = Job(spec.cluster, first, "blend-1", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()
    second = variant(base, tmp_path, "blend", run={"steps": 26})
    outcome = Job(spec.cluster, second, "blend-2", None, None).wait(300)
    assert outcome.ok, outcome.status.describe()

    sampling = Sampling.of(second, spec.cluster.world_size)
    assert sampling.blend is not None and sampling.n_samples == 90 and sampling.blend.quota == [27, 63]
    result = check_data_consistency(outcome.output_dir, sampling)
    assert result.passed, result.message
    assert result.measured["resumed_from_steps"] == [12]
    assert result.measured["epochs_complete_checked"] == [0, 1]
    shares = {s["source"]: s["observed_share"] for s in result.measured["sources"]}
    assert shares[0] == pytest.approx(0.3, abs=0.02) and shares[1] == pytest.approx(0.7, abs=0.02)
    assert result.measured["sources"][1]["passes_complete"] >= 3  # B ran through all its samples three times

    # what the ranks were fed is what the records say: each sample's tokens are of its source's letter band
    data = TokenDataset(url, "train", SEQ, trusted=sources)
    records = RunOutput(outcome.output_dir).all_sample_records()
    fed = [s for lines in records.values() for rec in lines for s in rec["samples"]]
    bands = {int(data.sample(s).min()) >= 97 for s in fed}
    assert bands == {True, False}
    blend = Blend([0.3, 0.7], [60, 30], second.run.seed)
    for lines in records.values():
        for rec in lines:
            assert rec["samples"] == blend.samples(rec["epoch"], rec["indices"]).tolist()


def test_per_source_checks_fail_when_draws_resolve_with_the_wrong_epoch(tmp_path: Path) -> None:
    """A trainer that resolved every epoch's draws as epoch 0's would feed a small source the same samples each
    epoch: the per-source check names the repeats within one pass."""
    from training.run_output import EpochEnd, RunOutputWriter
    from training.sampler import GlobalBatchSampler

    blend = Blend([0.5, 0.5], [40, 10], seed=3)
    sampler = GlobalBatchSampler(blend.epoch_size, 5, 1, 1, 0, seed=3)
    out = RunOutputWriter(str(tmp_path), None)
    for step in range(1, 3 * sampler.steps_per_epoch + 1):
        offset = sampler.state.offset if not sampler.epoch_done else 0
        epoch, (draws,) = sampler.next_step()
        samples = blend.samples(0, draws)  # the bug: epoch 0's resolution every epoch
        out.append_samples(0, {"step": step, "epoch": epoch, "offset": offset, "resumed_from": None,
                               "indices": draws.tolist(), "samples": samples.tolist()})  # fmt: skip
        if sampler.epoch_done:
            out.append_epoch(EpochEnd(epoch, step, blend.epoch_size, 5, sampler.remainder(epoch).tolist(), []))
    out.close()
    sampling = Sampling(blend.epoch_size, 5, 1, 1, 3, True, blend, (0.5, 0.5), (40, 10))
    result = check_data_consistency(tmp_path, sampling)
    assert not result.passed
    assert "blend source 0: samples drawn twice within one pass over the source" in result.message


def _records_of(blend: Blend, folder: Path, epochs: int = 3) -> None:
    """One rank's sample records of `epochs` epochs drawn through `blend` (5 draws a step)."""
    from training.run_output import EpochEnd, RunOutputWriter
    from training.sampler import GlobalBatchSampler

    sampler = GlobalBatchSampler(blend.epoch_size, 5, 1, 1, 0, seed=3)
    out = RunOutputWriter(str(folder), None)
    for step in range(1, epochs * sampler.steps_per_epoch + 1):
        offset = sampler.state.offset if not sampler.epoch_done else 0
        epoch, (draws,) = sampler.next_step()
        out.append_samples(0, {"step": step, "epoch": epoch, "offset": offset, "resumed_from": None,
                               "indices": draws.tolist(), "samples": blend.samples(epoch, draws).tolist()})  # fmt: skip
        if sampler.epoch_done:
            out.append_epoch(EpochEnd(epoch, step, blend.epoch_size, 5, sampler.remainder(epoch).tolist(), []))
    out.close()


@pytest.mark.parametrize("applied", [(0.3, 0.7), (0.7, 0.3)], ids=["as-defined", "inverted-by-the-trainer"])
def test_blend_proportions_are_judged_against_the_manifests_weights_not_the_trainers_quotas(
    tmp_path: Path, applied: tuple[float, float]
) -> None:
    """A trainer that applies the weights inverted (the 0.3 source drawn 70%) hands the check a Blend whose own
    quotas agree with what it drew; the expected shares come from the manifest's weights."""
    trainer_blend = Blend(list(applied), [60, 30], seed=3)
    _records_of(trainer_blend, tmp_path)
    sampling = Sampling(trainer_blend.epoch_size, 5, 1, 1, 3, True, trainer_blend, (0.3, 0.7), (60, 30))
    result = check_data_consistency(tmp_path, sampling)
    shares = {s["source"]: s["observed_share"] for s in result.measured["sources"]}
    assert shares[0] == pytest.approx(applied[0], abs=0.02)
    if applied == (0.3, 0.7):
        assert result.passed, result.message
    else:
        assert not result.passed
        assert "blend source 0: epochs 0, 1, 2 fed [63, 63, 63] of its samples, its weight 0.3 gives 27 of 90" in (
            result.message
        )
