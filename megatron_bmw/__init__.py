"""megatron_bmw: Megatron-style GPT pretraining with an automatic configuration planner."""

__version__ = "0.1.0"
