"""BERT micro-batches: the dataset's samples (data/bert_dataset.py) stacked into the dict the BERT units read
(models/bert.py), in Megatron's sampler order (training/batches.py)."""

from __future__ import annotations

import numpy as np
import torch

from ..models.bert import loss_divisors
from ..device import host_to_device
from .batches import MicroBatches


class BertMicroBatches(MicroBatches):
    def make(self, first_sample: int) -> dict[str, torch.Tensor]:
        n = len(self.dataset)
        rows = [self.dataset[(first_sample + j) % n] for j in range(self.mb)]

        def stack(key: str) -> torch.Tensor:
            return torch.from_numpy(np.stack([np.asarray(r[key], dtype=np.int64) for r in rows]))

        mask = stack("loss_mask").float()
        batch = {"tokens": stack("text"), "types": stack("types"), "padding_mask": stack("padding_mask").bool(),
                 "labels": stack("labels"), "loss_mask": mask,
                 "sop_labels": torch.tensor([int(r["is_random"]) for r in rows], dtype=torch.int64),
                 "loss_divisors": loss_divisors(mask)}
        return {k: host_to_device(v, self.device) for k, v in batch.items()}
