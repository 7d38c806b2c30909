"""Deterministic, resumable distributed sampling of global batches.

Each epoch is a permutation of all sample indices drawn from (seed, epoch). An
optimizer step consumes the next `global_batch` indices of it; micro-step m of
rank r takes `micro_batch` contiguous indices at offset
`m * world * micro_batch + r * micro_batch` inside that slice. So ranks are
disjoint by construction, a single process with `world * micro_batch` sees the
same samples per micro-step, and the position is just (epoch, offset), which
also stays valid when the world size changes on resume. An epoch covers
`len // global_batch * global_batch` samples; the rest (< one global batch) is
reshuffled into later epochs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplerState:
    """Position in the sample stream: the next global batch starts at `offset` of `epoch`'s permutation."""

    epoch: int = 0
    offset: int = 0


class GlobalBatchSampler:
    """Hands each rank its micro-batches of sample indices, step after step."""

    def __init__(
        self, n_samples: int, micro_batch: int, grad_accum_steps: int, world_size: int, rank: int, seed: int
    ) -> None:
        self.n_samples, self.micro_batch, self.accum = n_samples, micro_batch, grad_accum_steps
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.global_batch = micro_batch * grad_accum_steps * world_size
        if self.global_batch > n_samples:
            raise ValueError(
                f"global batch {self.global_batch} (micro_batch x grad_accum_steps x world_size) exceeds the "
                f"{n_samples} training samples; use a smaller batch or a larger dataset"
            )
        self.state = SamplerState()
        self._perm_epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`."""
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)
            self._perm_epoch = epoch
        return self._perm

    def epoch_samples(self, epoch: int) -> np.ndarray:
        """Every index that `epoch` hands out (over all ranks)."""
        steps = self.n_samples // self.global_batch
        return self.permutation(epoch)[: steps * self.global_batch]

    def next_step(self) -> tuple[int, list[np.ndarray]]:
        """This rank's micro-batches for the next optimizer step, and the epoch they belong to."""
        if self.state.offset + self.global_batch > self.n_samples:
            self.state = SamplerState(self.state.epoch + 1, 0)
        epoch, start = self.state.epoch, self.state.offset
        batch = self.permutation(epoch)[start : start + self.global_batch]
        per_micro = self.world_size * self.micro_batch
        micro = [
            batch[m * per_micro + self.rank * self.micro_batch : m * per_micro + (self.rank + 1) * self.micro_batch]
            for m in range(self.accum)
        ]
        self.state = SamplerState(epoch, start + self.global_batch)
        return epoch, micro
