"""Micro-batches for one iteration, taken from a dataset by consumed-sample count (Megatron's sampler order).

Within a global batch, micro-batch i of data-parallel rank d holds samples
consumed + (i * dp + d) * mb ... + mb - 1, so every layout sees the same global batch. With context parallelism
the ranks of a cp group load the same samples and keep their chunks of each sequence (models/chunk.py cp_shard).
"""

from __future__ import annotations

import numpy as np
import torch

from ..device import host_to_device
from ..models.chunk import cp_shard


class MicroBatches:
    def __init__(self, dataset, micro_batch_size: int, dp_size: int, dp_rank: int, device: torch.device,
                 eod: int | None = None, eod_mask_loss: bool = False, cp: tuple[int, int] = (1, 0)) -> None:
        self.dataset = dataset
        self.mb, self.dp, self.dp_rank = micro_batch_size, dp_size, dp_rank
        self.device = device
        self.eod = eod
        self.eod_mask_loss = eod_mask_loss
        self.cp = cp  # (context-parallel size, this rank's cp rank)

    def iteration(self, consumed_samples: int, num_microbatches: int) -> "IterationBatches":
        return IterationBatches(self, consumed_samples, num_microbatches)

    def make(self, first_sample: int) -> dict[str, torch.Tensor]:
        n = len(self.dataset)
        rows = [np.asarray(self.dataset[(first_sample + j) % n]["text"], dtype=np.int64) for j in range(self.mb)]
        text = torch.from_numpy(np.stack(rows))
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        mask = torch.ones(tokens.shape, dtype=torch.float32)
        if self.eod_mask_loss and self.eod is not None:
            mask[tokens == self.eod] = 0.0
        batch = cp_shard({"tokens": tokens, "labels": labels, "loss_mask": mask}, *self.cp)
        return {k: host_to_device(v, self.device) for k, v in batch.items()}


class IterationBatches:
    """Callable the engine uses: micro-batch index -> batch dict (built once, cached for the iteration)."""

    def __init__(self, source: MicroBatches, consumed: int, num_microbatches: int) -> None:
        self.source, self.consumed, self.m = source, consumed, num_microbatches
        self.cache: dict[int, dict] = {}

    def __call__(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self.cache:
            s = self.source
            self.cache[i] = s.make(self.consumed + (i * s.dp + s.dp_rank) * s.mb)
        return self.cache[i]
