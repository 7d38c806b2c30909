"""Deterministic, resumable distributed sampling of global batches.

Each epoch is a permutation of all sample indices drawn from (seed, epoch). An
optimizer step consumes the next `global_batch` indices of it; micro-step m of
rank r takes `micro_batch` contiguous indices at offset
`m * world * micro_batch + r * micro_batch` inside that slice. So ranks are
disjoint by construction, a single process with `world * micro_batch` sees the
same samples per micro-step, and the position is just (epoch, offset), which
also stays valid when the world size changes on resume.

An epoch that does not divide into global batches ends in one of two ways
(`data.drop_last`). Dropping (the default): the epoch runs `len // global_batch`
steps and its last `len % global_batch` indices (the remainder) are left out of
that epoch; the next epoch's permutation has them somewhere else. Padding: the
epoch runs `ceil(len / global_batch)` steps and its last batch is filled up by
wrapping around to the start of the same epoch's order (as torch's
DistributedSampler pads), so every sample is seen and the first few twice. The
trainer records each epoch's remainder or padding (`remainder`, `padding`) in
the run output, where data consistency checks it against the dataset's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class SamplerState:
    """Position in the sample stream: the next global batch starts at `offset` of `epoch`'s permutation."""

    epoch: int = 0
    offset: int = 0


class GlobalBatchSampler:
    """Hands each rank its micro-batches of sample indices, step after step."""

    def __init__(
        self,
        n_samples: int,
        micro_batch: int,
        grad_accum_steps: int,
        world_size: int,
        rank: int,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        self.n_samples, self.micro_batch, self.accum = n_samples, micro_batch, grad_accum_steps
        self.world_size, self.rank, self.seed, self.drop_last = world_size, rank, seed, drop_last
        self.global_batch = micro_batch * grad_accum_steps * world_size
        if self.global_batch > n_samples:
            raise ValueError(
                f"global batch {self.global_batch} (micro_batch x grad_accum_steps x world_size) exceeds the "
                f"{n_samples} training samples; use a smaller batch or a larger dataset"
            )
        self.state = SamplerState()
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps of one epoch: the whole batches, plus the padded last one when not dropping."""
        whole, rest = divmod(self.n_samples, self.global_batch)
        return whole + int(rest > 0 and not self.drop_last)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`."""
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)
            self._perm_epoch = epoch
        return self._perm

    def epoch_samples(self, epoch: int) -> np.ndarray:
        """Every index that `epoch` hands out (over all ranks), in order; padding repeats the first ones."""
        order = self.permutation(epoch)
        return np.concatenate([order[: self.steps_per_epoch * self.global_batch], self.padding(epoch)])

    def remainder(self, epoch: int) -> np.ndarray:
        """The indices `epoch` leaves out when dropping the last partial batch (empty when padding)."""
        if not self.drop_last:
            return self.permutation(epoch)[:0]
        return self.permutation(epoch)[self.steps_per_epoch * self.global_batch :]

    def padding(self, epoch: int) -> np.ndarray:
        """The indices `epoch` hands out a second time to fill its last batch (empty when dropping)."""
        return self.permutation(epoch)[: max(0, self.steps_per_epoch * self.global_batch - self.n_samples)]

    @property
    def epoch_done(self) -> bool:
        """The current epoch has handed out its last batch: the next step starts the next epoch."""
        if self.drop_last:
            return self.state.offset + self.global_batch > self.n_samples
        return self.state.offset >= self.n_samples

    def position(self, steps_done: int) -> SamplerState:
        """Where step `steps_done + 1` of an uninterrupted run (this global batch, from the start) begins."""
        epoch, step = divmod(steps_done, self.steps_per_epoch)
        return SamplerState(epoch, step * self.global_batch)

    def next_step(self) -> tuple[int, list[np.ndarray]]:
        """This rank's micro-batches for the next optimizer step, and the epoch they belong to."""
        if self.epoch_done:
            self.state = SamplerState(self.state.epoch + 1, 0)
        epoch, start = self.state.epoch, self.state.offset
        order = self.permutation(epoch)
        if start + self.global_batch <= self.n_samples:
            batch = order[start : start + self.global_batch]
        else:  # the padded last batch: wrap around to the start of this epoch's order
            batch = order[np.arange(start, start + self.global_batch) % self.n_samples]
        per_micro = self.world_size * self.micro_batch
        micro = [
            batch[m * per_micro + self.rank * self.micro_batch : m * per_micro + (self.rank + 1) * self.micro_batch]
            for m in range(self.accum)
        ]
        self.state = SamplerState(epoch, start + self.global_batch)
        return epoch, micro


class Blend:
    """A weighted mix of sources, drawn epoch by epoch from (seed, epoch) alone.

    An epoch has `epoch_size` draws (by default the sources' total samples), source s taking `quota[s]` of
    them: its weight's share, rounded by largest remainder so the quotas sum to the epoch size. The sampler
    permutes the epoch's draw ids [0, epoch_size) as it permutes a plain dataset's samples; draw id j
    belongs to the source whose quota block holds it. Each source runs through its own samples in cycles,
    every cycle a fresh permutation from (seed, source, cycle), and epoch e takes positions
    [e * quota, (e + 1) * quota) of that stream. So within a source no sample comes back before every other one
    has been drawn, across epochs, resumes and world sizes, and a small source with a large weight repeats in
    proportion (as Megatron's blended datasets oversample).
    """

    def __init__(self, weights: list[float], source_samples: list[int], seed: int, epoch_size: int | None = None):
        if len(weights) != len(source_samples) or not weights:
            raise ValueError(f"{len(weights)} weights for {len(source_samples)} sources")
        total = float(sum(weights))
        if not np.isfinite(total) or total <= 0 or min(weights) < 0:
            raise ValueError(f"blend weights {weights} must be >= 0 and sum to a positive number")
        empty = [s for s, (w, n) in enumerate(zip(weights, source_samples, strict=True)) if w > 0 and n == 0]
        if empty:
            raise ValueError(f"sources {empty} have a weight but no sample")
        self.weights = [w / total for w in weights]
        self.source_samples = list(source_samples)
        self.seed = seed
        self.epoch_size = epoch_size or sum(source_samples)
        exact = np.array(self.weights) * self.epoch_size
        quota = np.floor(exact).astype(np.int64)
        short = self.epoch_size - int(quota.sum())
        quota[np.argsort(-(exact - quota), kind="stable")[:short]] += 1
        self.quota = quota.tolist()
        self.block = np.concatenate(([0], np.cumsum(quota))).astype(np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(source_samples))).astype(np.int64)
        self._cycles: dict[tuple[int, int], np.ndarray] = {}

    def source_of(self, draws: np.ndarray) -> np.ndarray:
        """The source of each draw id."""
        return np.searchsorted(self.block, np.asarray(draws), side="right") - 1

    def _cycle(self, source: int, cycle: int) -> np.ndarray:
        key = (source, cycle)
        if key not in self._cycles:
            if len(self._cycles) > 64:
                self._cycles.clear()
            self._cycles[key] = np.random.default_rng([self.seed, 1 + source, cycle]).permutation(
                self.source_samples[source]
            )
        return self._cycles[key]

    def samples(self, epoch: int, draws: np.ndarray | list[int]) -> np.ndarray:
        """The dataset's sample index of each draw id of `epoch`."""
        draws = np.asarray(draws, dtype=np.int64)
        sources = self.source_of(draws)
        out = np.empty(draws.size, dtype=np.int64)
        for k, (draw, source) in enumerate(zip(draws.tolist(), sources.tolist(), strict=True)):
            n = self.source_samples[source]
            position = epoch * self.quota[source] + draw - int(self.block[source])
            out[k] = self.offsets[source] + self._cycle(source, position // n)[position % n]
        return out

    def source_of_sample(self, samples: np.ndarray | list[int]) -> np.ndarray:
        """The source of each dataset sample index."""
        return np.searchsorted(self.offsets, np.asarray(samples), side="right") - 1


def blend_of(dataset: Any, seed: int) -> Blend | None:
    """The blend of a training split whose manifest mixes weighted sources, or None."""
    blend = dataset.manifest.blend
    if not blend or len(blend) < 2:
        return None
    try:
        return Blend([source.weight for source in blend], dataset.source_samples, seed)
    except ValueError as err:
        from training.dataset import DatasetError  # noqa: PLC0415 - the dataset's own error type

        raise DatasetError(
            dataset.url, f"split {dataset.split!r}: {err}", "give every weighted source training samples"
        ) from err
