"""The tokenized dataset format and the distributed sampler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tasks.prepare.corpus import split_of
from training.dataset import DatasetError, DatasetWriter, TokenDataset, TokenizerInfo, read_manifest, verify_dataset
from training.sampler import GlobalBatchSampler, SamplerState


def _write(url: str, docs: dict[str, list[list[int]]], vocab: int = 100, shard_tokens: int = 64) -> None:
    with DatasetWriter(url, vocab, TokenizerInfo(kind="bytes"), eos_id=vocab - 1, shard_tokens=shard_tokens) as w:
        for split, items in docs.items():
            for doc in items:
                w.add_document(split, doc)


def test_written_dataset_reads_back_as_samples(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    docs = [list(range(i, i + 30)) for i in range(10)]
    _write(url, {"train": docs, "val": docs[:2]})
    manifest = read_manifest(url)
    stream = np.concatenate([np.append(d, 99) for d in docs])
    assert manifest.splits["train"].n_tokens == stream.size == 310
    assert manifest.splits["train"].n_docs == 10 and len(manifest.splits["train"].shards) > 1
    ds = TokenDataset(url, "train", seq_len=8)
    # every sample is a contiguous window of its shard, L + 1 tokens long
    first = ds.sample(0)
    assert first.tolist() == stream[:9].tolist()
    assert ds.batch([0, 1]).shape == (2, 9)
    assert verify_dataset(url) == []


def test_unfinished_dataset_is_never_read(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    with pytest.raises(RuntimeError):
        with DatasetWriter(url, 100, TokenizerInfo(kind="bytes"), eos_id=99) as writer:
            writer.add_document("train", [1, 2, 3])
            raise RuntimeError("killed while writing")
    with pytest.raises(DatasetError, match="unfinished"):
        TokenDataset(url, "train", seq_len=2)


def test_out_of_vocabulary_token_is_refused(tmp_path: Path) -> None:
    writer = DatasetWriter(str(tmp_path / "ds"), 10, TokenizerInfo(kind="bytes"), eos_id=9)
    with pytest.raises(ValueError, match="token id 12 outside the vocabulary"):
        writer.add_document("train", [1, 12])
    with pytest.raises(DatasetError, match="no documents were written"):
        writer.close()


def test_verify_reports_a_corrupted_shard(tmp_path: Path) -> None:
    url = str(tmp_path / "ds")
    _write(url, {"train": [list(range(50))]})
    shard = tmp_path / "ds" / "train" / "tokens-00000.bin"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify_dataset(url) == ["train: train/tokens-00000.bin sha256 differs from the manifest"]


def test_split_by_hash_is_stable_when_documents_are_added() -> None:
    docs = [f"document number {i}" for i in range(500)]
    before = {d: split_of(d, 0.1) for d in docs}
    after = {d: split_of(d, 0.1) for d in docs + [f"new {i}" for i in range(100)]}
    assert all(after[d] == s for d, s in before.items())
    assert 20 < sum(s == "val" for s in before.values()) < 80


def test_ranks_get_disjoint_samples_that_cover_each_epoch() -> None:
    n, world, b, accum = 103, 2, 3, 2
    samplers = [GlobalBatchSampler(n, b, accum, world, r, seed=5) for r in range(world)]
    steps_per_epoch = n // (b * accum * world)
    for epoch in range(2):
        seen = [[], []]
        for _ in range(steps_per_epoch):
            for r, sampler in enumerate(samplers):
                got_epoch, micro = sampler.next_step()
                assert got_epoch == epoch
                seen[r].extend(np.concatenate(micro).tolist())
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == sorted(samplers[0].epoch_samples(epoch).tolist())
    assert not np.array_equal(samplers[0].permutation(0), samplers[0].permutation(1))


def test_single_process_with_double_batch_sees_the_same_samples() -> None:
    two = [GlobalBatchSampler(64, 4, 1, 2, r, seed=1) for r in range(2)]
    one = GlobalBatchSampler(64, 8, 1, 1, 0, seed=1)
    for _ in range(5):
        ranks = [s.next_step()[1][0] for s in two]
        assert np.concatenate(ranks).tolist() == one.next_step()[1][0].tolist()


def test_sampler_resumes_mid_epoch_from_its_position() -> None:
    straight = GlobalBatchSampler(50, 2, 1, 2, 1, seed=3)
    expected = [straight.next_step() for _ in range(30)]
    resumed = GlobalBatchSampler(50, 2, 1, 2, 1, seed=3)
    for _ in range(17):
        resumed.next_step()
    position = SamplerState(resumed.state.epoch, resumed.state.offset)
    fresh = GlobalBatchSampler(50, 2, 1, 2, 1, seed=3)
    fresh.state = position
    for epoch, micro in expected[17:]:
        got_epoch, got = fresh.next_step()
        assert got_epoch == epoch and got[0].tolist() == micro[0].tolist()


def test_global_batch_larger_than_dataset_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="global batch 16 .* exceeds the 10 training samples"):
        GlobalBatchSampler(10, 8, 1, 2, 0, seed=0)
