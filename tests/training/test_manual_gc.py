"""--manual-gc: Python's collector is off during training and runs at Megatron's moments (start, every
--manual-gc-interval iterations, around validation); it is back on afterwards."""

import gc

import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.training.loop import build_trainer

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
       "--lr", "1e-3", "--log-interval", "100", "--eval-iters", "1", "--make-vocab-size-divisible-by", "4",
       "--train-iters", "6"]


def _collections(monkeypatch, argv: list[str]) -> tuple[list, list]:
    calls, enabled = [], []
    real = gc.collect

    def collect(generation=2):
        calls.append(generation)
        enabled.append(gc.isenabled())
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    trainer = build_trainer(argv)
    trainer.train()
    assert gc.isenabled()
    return calls, enabled


def test_manual_gc_collects_at_megatrons_moments(monkeypatch):
    calls, enabled = _collections(monkeypatch, GPT + ["--manual-gc", "--manual-gc-interval", "2",
                                                       "--eval-interval", "3"])
    # start; iterations 2, 4, 6; around the validation at iteration 3 and 6 (full before, generation 0 after)
    assert calls == [2, 2, 2, 0, 2, 2, 2, 0] and not any(enabled)


def test_manual_gc_without_interval_or_eval(monkeypatch):
    calls, _ = _collections(monkeypatch, GPT + ["--manual-gc", "--no-manual-gc-eval", "--eval-interval", "3"])
    assert calls == [2]
    assert _collections(monkeypatch, GPT)[0] == []  # without --manual-gc the interpreter's collector decides


def test_manual_gc_interval_must_not_be_negative():
    with pytest.raises(UsageError, match="--manual-gc-interval must be >= 0"):
        build_trainer(GPT + ["--manual-gc-interval", "-1"])
