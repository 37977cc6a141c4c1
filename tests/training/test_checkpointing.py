import os

import pytest
import torch
from torch import nn

from megatron_bmw.config import ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.layout import RankLayout
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.training.checkpointing import load_checkpoint, read_tracker, save_checkpoint, load_error
from megatron_bmw.config import OptimizerConfig
from megatron_bmw.training.optimizer import build_optimizer
from tests.dist_harness import run_distributed


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))


def _grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.main_grad = torch.randn(p.shape, generator=gen) * 0.1


def _payload(model, state, iteration):
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "iteration": iteration,
        "args": {"tensor_model_parallel_size": state.tp_size, "pipeline_model_parallel_size": state.pp_size},
    }


def _train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        _grads(model, step)
        assert opt.step().successful


def _state(tp, pp, rank=0):
    return ParallelState(layout=RankLayout(tp, 1, pp), rank=rank)


class _Boom:
    def __reduce__(self):
        raise RuntimeError("crash while pickling")


def test_round_trip_layout_and_resume(tmp_path):
    state = ParallelState.serial()
    cfg = OptimizerConfig(lr=1e-2, bf16=True)
    model = _model().to(torch.bfloat16)
    opt = build_optimizer(list(model.named_parameters()), cfg, state)
    _train(model, opt, 3)
    out = save_checkpoint(str(tmp_path), 10, state, _payload(model, state, 10), opt)
    assert out == str(tmp_path / "iter_0000010")
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "10"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert sorted(os.listdir(tmp_path / "iter_0000010" / "mp_rank_00")) == ["checksums.json", "model_optim_rng.pt"]

    model2 = _model(seed=1).to(torch.bfloat16)
    opt2 = build_optimizer(list(model2.named_parameters()), cfg, state)
    payload = load_checkpoint(str(tmp_path), state, opt2)
    assert payload["iteration"] == 10 and "optimizer" not in payload
    model2.load_state_dict(payload["model"])
    _train(model, opt, 2, start=3)
    _train(model2, opt2, 2, start=3)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_without_optimizer_state_masters_follow_loaded_weights(tmp_path):
    state = ParallelState.serial()
    cfg = OptimizerConfig(lr=1e-2, bf16=True)
    model = _model().to(torch.bfloat16)
    save_checkpoint(str(tmp_path), 4, state, _payload(model, state, 4), None)
    model2 = _model(seed=3).to(torch.bfloat16)
    opt2 = build_optimizer(list(model2.named_parameters()), cfg, state)
    with pytest.raises(UsageError, match="has no optimizer state"):
        load_checkpoint(str(tmp_path), state, opt2)
    payload = load_checkpoint(str(tmp_path), state, opt2, load_optim=False)
    model2.load_state_dict(payload["model"])
    for p in model2.parameters():
        p.main_grad = torch.zeros(p.shape)
    opt2.set_lr(0.0)
    opt2.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    state = ParallelState.serial()
    model = _model()
    save_checkpoint(str(tmp_path), 10, state, _payload(model, state, 10), None)
    bad = _payload(model, state, 20)
    bad["rng"] = _Boom()
    with pytest.raises(RuntimeError, match="crash while pickling"):
        save_checkpoint(str(tmp_path), 20, state, bad, None)
    assert read_tracker(str(tmp_path)) == 10
    assert not (tmp_path / "iter_0000020").exists()
    assert load_checkpoint(str(tmp_path), state)["iteration"] == 10
    # the next successful save of the same iteration clears the debris
    save_checkpoint(str(tmp_path), 20, state, _payload(model, state, 20), None)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "iter_0000020", "latest_checkpointed_iteration.txt"]


def test_a_full_disk_under_torchs_zip_writer_is_one_line_and_leaves_no_debris(tmp_path, monkeypatch):
    """torch 2.13's zip writer, hitting ENOSPC, raises "unexpected pos" while handling the OSError: the save names
    the disk error, keeps the previous checkpoint and removes its temporary folder (probe, session 12)."""
    import errno

    from megatron_bmw.errors import RunError

    state = ParallelState.serial()
    model = _model()
    save_checkpoint(str(tmp_path), 10, state, _payload(model, state, 10), None)

    def full(obj, f, *a, **k):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1010752 vs 1010640")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(RunError, match="iteration 20 .No space left on device.; the previous checkpoint is kept"):
        save_checkpoint(str(tmp_path), 20, state, _payload(model, state, 20), None)
    assert sorted(os.listdir(tmp_path)) == ["iter_0000010", "latest_checkpointed_iteration.txt"]


def test_resave_same_iteration_and_interrupted_swap(tmp_path):
    state = ParallelState.serial()
    model = _model()
    save_checkpoint(str(tmp_path), 10, state, {**_payload(model, state, 10), "tag": "a"}, None)
    save_checkpoint(str(tmp_path), 10, state, {**_payload(model, state, 10), "tag": "b"}, None)
    assert load_checkpoint(str(tmp_path), state)["tag"] == "b"
    os.rename(tmp_path / "iter_0000010", tmp_path / "iter_0000010.old-0123")  # cut between the two renames
    assert load_checkpoint(str(tmp_path), state)["tag"] == "b"


def test_tracker_cases(tmp_path):
    state = ParallelState.serial()
    assert load_checkpoint(str(tmp_path / "nothing"), state) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana\n")
    with pytest.raises(UsageError, match="not an iteration number"):
        load_checkpoint(str(tmp_path), state)
    (tmp_path / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\x00\xff")
    with pytest.raises(UsageError, match="not an iteration number"):
        load_checkpoint(str(tmp_path), state)
    os.makedirs(tmp_path / "release" / "mp_rank_00")
    torch.save({"iteration": 0, "args": {}}, tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert load_checkpoint(str(tmp_path), state) == {"iteration": 0, "args": {}}
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    with pytest.raises(UsageError, match="iteration 30"):
        load_checkpoint(str(tmp_path), state)


def test_parallel_size_mismatch_refused(tmp_path):
    state = ParallelState.serial()
    save_checkpoint(str(tmp_path), 1, state, _payload(_model(), state, 1), None)
    for tp, pp in ((2, 1), (1, 2)):
        msg = (
            f"--load {tmp_path}: checkpoint was saved with tensor/pipeline parallel sizes (1, 1), "
            f"but this run uses ({tp}, {pp}); to load it into this layout, convert it first: run with the saved "
            "layout and --ckpt-convert-format torch_dist --ckpt-convert-save OUT, then --load OUT/torch_dist"
        )
        with pytest.raises(UsageError) as err:
            load_checkpoint(str(tmp_path), _state(tp, pp))
        assert str(err.value) == msg


def _distributed_layouts(rank, world_size, root):
    written = {}
    for name, pcfg in (
        ("tp2", ParallelConfig(tensor_model_parallel_size=2)),
        ("pp2", ParallelConfig(pipeline_model_parallel_size=2)),
        ("zero", ParallelConfig()),
    ):
        state = ParallelState.build(pcfg)
        model = _model()
        cfg = OptimizerConfig(lr=1e-2, use_distributed_optimizer=name == "zero")
        opt = build_optimizer(list(model.named_parameters()), cfg, state)
        _train(model, opt, 2)
        ckpt = os.path.join(root, name)
        save_checkpoint(ckpt, 7, state, _payload(model, state, 7), opt)
        written[name] = sorted(
            os.path.relpath(os.path.join(d, f), ckpt) for d, _, files in os.walk(ckpt) for f in files
        )
        if name == "zero":
            resumed = _model(seed=5)
            opt2 = build_optimizer(list(resumed.named_parameters()), cfg, state)
            resumed.load_state_dict(load_checkpoint(ckpt, state, opt2)["model"])
            plain = _model(seed=6)
            plain_opt = build_optimizer(list(plain.named_parameters()), OptimizerConfig(lr=1e-2), state)
            plain.load_state_dict(load_checkpoint(ckpt, state, plain_opt)["model"])
            for m, o in ((model, opt), (resumed, opt2), (plain, plain_opt)):
                _train(m, o, 2, start=2)
            for a, b, c in zip(model.parameters(), resumed.parameters(), plain.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
                torch.testing.assert_close(a, c, rtol=1e-6, atol=1e-7)
    return written


@pytest.mark.slow
def test_distributed_layouts_on_disk(tmp_path):
    """Megatron's file names per layout (the iteration folder holds only mp_rank_* folders), and in each of those a
    checksums.json with the size and digest of each file beside it."""
    import json

    from megatron_bmw.training import checksums

    written = run_distributed(2, _distributed_layouts, str(tmp_path))[0]
    expected = {
        "tp2": ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"],
        "pp2": ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
        "zero": ["mp_rank_00/distrib_optim.pt", "mp_rank_00/model_optim_rng.pt"],
    }
    for name, files in expected.items():
        folders = sorted({f.split("/")[0] for f in files})
        assert written[name] == sorted(["latest_checkpointed_iteration.txt"] + [f"iter_0000007/{f}" for f in files]
                                       + [f"iter_0000007/{d}/checksums.json" for d in folders]), name
        for d in folders:
            it = tmp_path / name / "iter_0000007" / d
            recorded = json.load(open(it / "checksums.json"))["files"]
            assert sorted(recorded) == [f.split("/")[1] for f in files if f.startswith(d + "/")]
            assert all(entry == checksums.digest(str(it / f)) for f, entry in recorded.items())


def _saved(tmp_path, distributed=False, checksums=False):
    """A checkpoint; without `checksums` as an older one (or Megatron-LM's), which only the reader checks."""
    state = ParallelState.serial()
    model = _model()
    opt = build_optimizer(list(model.named_parameters()),
                          OptimizerConfig(lr=1e-2, use_distributed_optimizer=distributed), state)
    _train(model, opt, 2)
    save_checkpoint(str(tmp_path), 5, state, _payload(model, state, 5), opt)
    if not checksums:
        os.remove(tmp_path / "iter_0000005" / "mp_rank_00" / "checksums.json")
    return state, opt, tmp_path / "iter_0000005" / "mp_rank_00"


def _one_line_error(tmp_path, state, opt, needle):
    with pytest.raises(UsageError) as err:
        load_checkpoint(str(tmp_path), state, opt)
    message = str(err.value)
    assert needle in message and "\n" not in message, message


def test_checkpoint_file_that_is_not_a_dict(tmp_path):
    state, opt, mp = _saved(tmp_path)
    torch.save([1, 2, 3], mp / "model_optim_rng.pt")
    _one_line_error(tmp_path, state, opt, f"{mp / 'model_optim_rng.pt'} holds a list, not a megatron_bmw checkpoint")


@pytest.mark.parametrize("name", ["model_optim_rng.pt", "distrib_optim.pt"])
def test_truncated_checkpoint_files(tmp_path, name):
    state, opt, mp = _saved(tmp_path, distributed=True)
    path = mp / name
    assert path.is_file()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    _one_line_error(tmp_path, state, opt, f"cannot read {path} (truncated or not a checkpoint")


def test_distrib_optim_without_params(tmp_path):
    state, opt, mp = _saved(tmp_path, distributed=True)
    torch.save({"other": 1}, mp / "distrib_optim.pt")
    _one_line_error(tmp_path, state, opt, "distrib_optim.pt holds a dict without 'params'")


def test_a_missing_stage_directory_is_named(tmp_path):
    state = ParallelState.serial()
    save_checkpoint(str(tmp_path), 1, state, _payload(_model(), _state(1, 2), 1), None)
    it = tmp_path / "iter_0000001"
    os.rename(it / "mp_rank_00", it / "mp_rank_00_000")  # stage 0 of a pp2 checkpoint whose stage 1 is gone
    with pytest.raises(UsageError) as err:
        load_checkpoint(str(tmp_path), _state(1, 2, rank=1))
    assert str(err.value) == (f"--load {tmp_path}: checkpoint file {it}/mp_rank_00_001/model_optim_rng.pt is "
                              "missing (its shard directory mp_rank_00_001 is gone)")


def test_another_architecture_or_size_is_named(tmp_path):
    """The torch format names the setting of another architecture before reading any state, and another size's
    tensor with both shapes (as torch_dist does)."""
    state = ParallelState.serial()
    model = _model()
    payload = _payload(model, state, 1)
    payload["args"].update(swiglu=False, num_layers=2)
    save_checkpoint(str(tmp_path), 1, state, payload)
    with pytest.raises(UsageError) as err:
        load_checkpoint(str(tmp_path), state, model_args={"swiglu": True, "num_layers": 2})
    assert str(err.value) == f"--load {tmp_path}: checkpoint has swiglu = False, this run True (another model)"
    loaded = load_checkpoint(str(tmp_path), state, model_args={"swiglu": False, "num_layers": 2, "normalization": None})
    wider = nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), nn.Linear(7, 3))
    with pytest.raises(RuntimeError) as exc:
        wider.load_state_dict(loaded["model"])
    assert load_error(exc.value) == "model tensor 0.weight has shape (7, 6) in this model but (5, 6) in the checkpoint"
    deeper = nn.Sequential(*_model(), nn.Linear(3, 3))
    with pytest.raises(RuntimeError) as exc:
        deeper.load_state_dict(loaded["model"])
    assert load_error(exc.value).startswith("the checkpoint has no tensor 3.weight")
    with pytest.raises(RuntimeError) as exc:
        nn.Sequential(nn.Linear(6, 5)).load_state_dict(loaded["model"])
    assert load_error(exc.value).startswith("the checkpoint has tensor 1.weight, which this model does not")
