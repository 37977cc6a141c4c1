"""Activation store: saved-tensor capture, eviction and loading (memory really freed, gradients bit for bit),
accounting, and stacking with activation recomputation."""

import gc
import weakref

import pytest
import torch
from torch import nn

from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.activation_store import ActivationStore
from tests.reference import SEED, make_batch, recompute_of, small_config


class _Done:
    """A transfer that has already completed (the wire is a dict)."""

    def __init__(self, buf):
        self.buf = buf
        self.waited = False

    def wait(self):
        self.waited = True
        return self.buf


class _Wire:
    def __init__(self):
        self.data = {}
        self.sends = []

    def send(self, key):
        def post(buf):
            self.data[key] = buf.clone()
            t = _Done(buf)
            self.sends.append(t)
            return t
        return post

    def recv(self, key):
        def post(buf):
            buf.copy_(self.data.pop(key))
            return _Done(buf)
        return post


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # tanh saves its output
        a, b = h.chunk(2, dim=1)  # two views of one storage, both saved by the product
        return (a * b).sum() + (h.exp() * 2).sum()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_evict_frees_memory_and_load_restores_exactly():
    torch.manual_seed(0)
    model, x = _Toy(), torch.randn(4, 8, requires_grad=True)
    model(x).backward()
    ref, ref_x = _grads(model), x.grad.clone()
    model.zero_grad()
    x.grad = None

    store, wire = ActivationStore("cpu", list(model.parameters())), _Wire()
    key = (0, 0, None)
    with store.capture(key):
        loss = model(x)
    entry = store._entries[key]
    assert all(not isinstance(t, nn.Parameter) and t._base is not model.lin.weight for t in entry.tensors)
    assert store.nbytes(key) > 0 and store.live_microbatches == 1
    watched = [weakref.ref(t) for t in entry.tensors if t is not x]
    store.evict(key, wire.send(key))
    assert store.live_microbatches == 1  # its send overlaps the next compute
    store.settle()
    assert store.live_microbatches == 0 and store.live_bytes == 0
    gc.collect()
    assert all(w() is None for w in watched)  # nothing else held the evicted activations

    with pytest.raises(RuntimeError, match="are away"):
        loss.backward(retain_graph=True)
    store.load(key, wire.recv(key))
    assert store.live_microbatches == 1
    store.ready(key)
    views = [t for t in store._entries[key].tensors if t.shape == (4, 4)]
    assert len({t.untyped_storage().data_ptr() for t in views}) == 1  # views of one storage still share it
    loss.backward()
    store.release(key)
    assert [torch.equal(a, b) for a, b in zip(_grads(model), ref)] == [True, True]
    assert torch.equal(x.grad, ref_x)
    assert store.live_bytes == 0 and store.peak_microbatches == 1


def test_accounting_halves_and_accepted():
    store, wire = ActivationStore("cpu"), _Wire()
    x = torch.randn(6, requires_grad=True)
    outs = {}
    for key in ((0, 0, 0), (0, 0, 1), (1, 0, None)):
        with store.capture(key, 0.5 if key[2] is not None else 1.0):
            outs[key] = (x.exp() * x).sum()
    assert store.live_microbatches == 2.0 and store.peak_microbatches == 2.0
    size = store.transfer_size((1, 0, None))
    store.accept((3, (7, 0, None)), size, 1.0, lambda buf: _Done(buf))
    assert store.live_microbatches == 3.0 and store.accepted_bytes == size
    store.give_back((3, (7, 0, None)), lambda buf: _Done(buf))
    assert store.accepted_bytes == size  # still counted until its send has completed
    store.settle()
    assert store.accepted_bytes == 0 and store.peak_accepted_bytes == size
    assert store.stats()["peak_microbatches"] == 3.0 and store.stats()["peak_accepted_microbatches"] == 1.0
    for key, out in outs.items():
        out.backward()
        store.release(key)
    assert store.live_microbatches == 0 and store.live_bytes == 0
    with pytest.raises(RuntimeError, match="already stored"):
        with store.capture((2, 0, None)):
            pass
        with store.capture((2, 0, None)):
            pass


@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_stacks_with_recomputation(recompute):
    """Recomputation's own hooks take over inside checkpointed regions; the store sees what they keep (their
    inputs), and evicting and loading those keeps gradients bit for bit."""
    cfg = small_config(num_layers=2)
    model = ModelChunk(build_units(cfg, ParallelState.serial(), SEED,
                                 recompute=recompute_of({"recompute_granularity": recompute}, 2)))
    batch = make_batch(cfg, 4, 3)
    model(None, batch).backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    store, wire = ActivationStore("cpu", list(model.parameters())), _Wire()
    key = (0, 0, None)
    with store.capture(key):
        loss = model(None, batch)
    nbytes = store.nbytes(key)
    store.evict(key, wire.send(key))
    store.settle()
    store.load(key, wire.recv(key))
    store.ready(key)
    loss.backward()
    store.release(key)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, ref[n]), n
    plain = ActivationStore("cpu", list(model.parameters()))
    if recompute is not None:
        cfg0 = small_config(num_layers=2)
        m0 = ModelChunk(build_units(cfg0, ParallelState.serial(), SEED))
        with plain.capture(key):
            m0(None, batch)
        assert nbytes < plain.nbytes(key)  # recomputation keeps less
