"""Loss scalers for fp16 training.

DynamicLossScaler follows Megatron's rules:
- an overflow resets the growth counter and decrements the hysteresis counter; the scale is multiplied by
  `backoff_factor` (never below `min_scale`) when that counter has reached 0. The hysteresis counter is
  refilled only when the scale grows, so it counts overflows since the last growth, not consecutive ones,
  and once it is spent every further overflow backs off.
- after `growth_interval` overflow-free steps in a row the scale is multiplied by `growth_factor` and the
  hysteresis counter is refilled.
"""

from __future__ import annotations


class _Scaler:
    _scale: float

    @property
    def scale(self) -> float:
        return self._scale

    @property
    def inv_scale(self) -> float:
        return 1.0 / self._scale


class ConstantLossScaler(_Scaler):
    """A fixed scale (`--loss-scale`, or 1.0 when no scaling is needed)."""

    def __init__(self, scale: float = 1.0) -> None:
        if scale <= 0:
            raise ValueError(f"loss scale must be > 0, got {scale}")
        self._scale = float(scale)


    def update(self, found_inf: bool) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict:
        return {"scale": self._scale}

    def load_state_dict(self, sd: dict) -> None:
        """The configured scale wins over the saved one."""


class DynamicLossScaler(_Scaler):
    """Megatron's dynamic scaler with hysteresis (see module doc)."""

    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ) -> None:
        if not 0 < min_scale <= initial_scale:
            raise ValueError(f"need 0 < min_scale <= initial_scale, got {min_scale}, {initial_scale}")
        if growth_factor <= 1.0 or not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"need growth_factor > 1 and 0 < backoff_factor < 1, got {growth_factor}/{backoff_factor}")
        if growth_interval < 1 or hysteresis < 1:
            raise ValueError(f"need growth_interval >= 1 and hysteresis >= 1, got {growth_interval}, {hysteresis}")
        self._scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self._growth_tracker = 0
        self._hysteresis_tracker = hysteresis


    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            self._scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, sd: dict) -> None:
        self._scale = float(sd["scale"])
        self._growth_tracker = int(sd["growth_tracker"])
        self._hysteresis_tracker = int(sd["hysteresis_tracker"])
