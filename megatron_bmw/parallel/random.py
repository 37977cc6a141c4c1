"""Random-number state: seeding, and a tracker whose fork gives each tensor-parallel rank its own stream.

Dropout inside tensor-parallel regions (attention probabilities, sequence-parallel hidden states) runs under
`tracker.fork()` and so differs per tp rank; dropout elsewhere uses the default generator, identical on all tp
ranks of a stage.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from ..device import get_rng_state as device_rng_state
from ..device import set_rng_state as set_device_rng_state

TP_RNG = "model-parallel-rng"


class RNGTracker:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        self.states[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = TP_RNG):
        if name not in self.states:
            yield
            return
        original = device_rng_state(self.device)
        set_device_rng_state(self.device, self.states[name])
        try:
            yield
        finally:
            self.states[name] = device_rng_state(self.device)
            set_device_rng_state(self.device, original)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}


def set_seeds(seed: int, tp_rank: int, pp_rank: int, tracker: RNGTracker) -> None:
    """Megatron's seeding: default streams differ per pipeline stage, the TP stream per tensor-parallel rank."""
    stage_seed = seed + 100 * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tracker.add(TP_RNG, seed + 2718 + tp_rank)


def get_rng_state(tracker: RNGTracker) -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tracker.get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, tracker: RNGTracker) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tracker.set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
