"""ZeRO-1's bucketed parameter all-gather: the shard layout, --overlap-param-gather equal to the gather done at
once (losses, grad norms and every parameter after each step, a checkpoint saved with gathers still running)
and to the serial model, and the flag's refusals."""

import os
from dataclasses import replace

import pytest
import torch
from torch import nn

from megatron_bmw.arguments import build_parser, configs_from_args, parse_args
from megatron_bmw.config import OptimizerConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.planner.plan_fields import check_plan_fields
from megatron_bmw.training.optimizer import build_optimizer
from megatron_bmw.training.param_gather import ShardLayout
from tests.dist_harness import run_distributed
from tests.planner.test_plan import _plan
from tests.training.test_pretrain import BASE, _layouts_case

ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
BUCKET = 3000  # elements: the small test model's parameters fall into several buckets


def test_layout_buckets_hold_whole_parameters_and_every_rank_an_equal_part():
    numels = [5, 7, 2, 11, 3]
    layout = ShardLayout(numels, dp=4, bucket_size=9)
    assert [b.params for b in layout.buckets] == [(0, 1), (2, 3), (4,)]
    assert [b.size for b in layout.buckets] == [12, 16, 4]  # 12, 13 and 3 elements padded to multiples of 4
    assert layout.offsets == [0, 5, 12, 14, 28] and layout.shard_size == 3 + 4 + 1
    covered = sorted(x for r in range(4) for lo, hi, _ in layout.rank_ranges(r) for x in range(lo, hi))
    assert covered == list(range(32))  # the ranks' ranges tile the padded space
    shards = [torch.zeros(layout.shard_size) for _ in range(4)]
    for r in range(4):
        for lo, hi, at in layout.rank_ranges(r):
            shards[r][at: at + hi - lo] = torch.arange(lo, hi, dtype=torch.float32)
    assert torch.equal(layout.unshard(shards), torch.arange(32, dtype=torch.float32))
    one = ShardLayout(numels, dp=2, bucket_size=10**9)  # one bucket: rank r owns [r*S, (r+1)*S) of all
    assert len(one.buckets) == 1 and one.rank_ranges(1) == [(14, 28, 0)]


def _flags(argv):
    return configs_from_args(parse_args(BASE + ["--train-iters", "3"] + argv, build_parser()), 2)


def test_overlap_param_gather_refused_without_the_distributed_optimizer_or_overlapped_grads():
    with pytest.raises(UsageError, match="^--overlap-param-gather is only supported with the distributed optimizer"):
        _flags(["--overlap-param-gather", "--overlap-grad-reduce"])
    with pytest.raises(UsageError, match="^--overlap-param-gather needs --overlap-grad-reduce"):
        _flags(["--overlap-param-gather", "--use-distributed-optimizer"])
    with pytest.raises(UsageError, match="^--unit-strategies cannot be combined with --overlap-param-gather"):
        _flags(["--unit-strategies", "dp2", "--overlap-param-gather", "--overlap-grad-reduce"])
    run = _flags(ZERO1 + ["--overlap-param-gather"])
    assert run.optimizer.overlap_param_gather and run.optimizer.use_distributed_optimizer
    data = _plan().to_json()
    assert data["training"]["overlap_param_gather"] is False
    check_plan_fields(dict(data, training=dict(data["training"], overlap_param_gather=True)), "plan")
    with pytest.raises(UsageError, match="training.overlap_param_gather needs training.distributed_optimizer"):
        check_plan_fields(dict(data, training=dict(data["training"], overlap_param_gather=True,
                                                   distributed_optimizer=False)), "plan")


def test_weights_made_non_finite_are_seen_in_the_shard():
    named = [("w", nn.Parameter(torch.full((4, 3), 60000.0, dtype=torch.float16)))]
    cfg = OptimizerConfig(lr=1e4, clip_grad=0.0, fp16=True, loss_scale=1.0, use_distributed_optimizer=True)
    opt = build_optimizer(named, cfg, ParallelState.serial())
    named[0][1].main_grad = -torch.ones(4, 3)
    res = opt.step()
    assert res.successful and not res.weights_finite and not torch.isfinite(named[0][1].detach()).all()


def _trainer(argv, world_size):
    from megatron_bmw.training.loop import Trainer

    run = configs_from_args(parse_args(argv, build_parser()), world_size)
    run = replace(run, optimizer=replace(run.optimizer, param_bucket_size=BUCKET))
    trainer = Trainer(run, ParallelState.build(run.parallel, num_units=run.model.num_units))
    trainer.load()
    return trainer


def _steps(trainer, iterations):
    """(the parameters the next forward used, per iteration; whether gathers were running after each step; the
    modules whose forward began with a gather of their parameters still running): the parameters are taken when
    the chunk's forward has run, so they are what its modules' pre-hooks completed."""
    (chunk,) = trainer.chunks
    gather, index = trainer.optimizer._gather, {id(p): i for i, p in enumerate(trainer.optimizer.params)}
    taken, early = [], []

    def after_forward(module, args, out):
        if len(taken) < len(trainer.history):
            taken.append([p.detach().clone() for _, p in trainer.named_params])

    def check(name, buckets):
        def pre_hook(module, args):  # registered after the optimizer's own: sees what it left
            if any(b in gather._pending for b in buckets):
                early.append(name)
        return pre_hook

    handles = [chunk.register_forward_hook(after_forward)]
    for name, m in chunk.named_modules():
        mine = {gather.layout.bucket_of[index[id(p)]] for p in m.parameters(recurse=False)}
        if mine:
            handles.append(m.register_forward_pre_hook(check(name, mine)))
    pending = []
    for _ in range(iterations):
        it = trainer.train_step()
        trainer.history.append((trainer.iteration, it.loss, it.step.grad_norm))
        pending.append(gather.pending)
    for h in handles:
        h.remove()
    return taken, pending, early


def _overlap_case(rank, world_size, layouts, ckpt):
    out = {}
    for name, layout in layouts.items():
        results = {}
        for overlap in (False, True):
            where = os.path.join(ckpt, f"{name}-{overlap}")
            argv = BASE + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
                           "--vocab-size", "128", "--save", where] + ZERO1 + layout
            trainer = _trainer(argv + (["--overlap-param-gather"] if overlap else []), world_size)
            assert len(trainer.optimizer._layout.buckets) > 2
            taken, pending, early = _steps(trainer, 3)
            assert not early, (name, early[:3])
            trainer.save()  # right after the step: with overlap its gathers are still running
            taken.append([p.detach().clone() for _, p in trainer.named_params])
            results[overlap] = (trainer.history, taken, pending, where)
            trainer.finish()
        (hist, params, waiting, _), (o_hist, o_params, o_waiting, _) = results[False], results[True]
        assert o_hist == hist and not any(waiting) and all(o_waiting), name
        for step, (a, b) in enumerate(zip(params, o_params)):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (name, step)
        out[name] = (o_hist, [results[o][3] for o in (False, True)])
    return out


@pytest.mark.slow
def test_overlap_param_gather_equals_gathering_at_once_and_serial(tmp_path):
    """dp4, tp2 x dp2 and pp2 x dp2 with ZeRO-1 in several buckets: with --overlap-param-gather the gathers are still
    running after each step and the next forward completes them; losses, grad norms, every parameter after each
    step and a checkpoint saved right after a step equal those of the run gathering at once, and the serial run."""
    layouts = {"dp4": [], "tp2-dp2": ["--tensor-model-parallel-size", "2"],
               "pp2-dp2": ["--pipeline-model-parallel-size", "2"]}
    serial = run_distributed(1, _layouts_case, [])[0]
    per_rank = run_distributed(4, _overlap_case, layouts, str(tmp_path))
    for name in layouts:
        hist, (plain_dir, overlap_dir) = per_rank[-1][name]
        for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, serial):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)
        for sub in sorted(os.listdir(os.path.join(plain_dir, "iter_0000003"))):
            a, b = (torch.load(os.path.join(d, "iter_0000003", sub, "model_optim_rng.pt"), weights_only=False)
                    for d in (plain_dir, overlap_dir))
            assert a["model"].keys() == b["model"].keys()
            assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), (name, sub)
            a, b = (torch.load(os.path.join(d, "iter_0000003", sub, "distrib_optim.pt"), weights_only=False)
                    for d in (plain_dir, overlap_dir))
            assert all(torch.equal(x[k], y[k]) for x, y in zip(a["params"], b["params"]) for k in x), (name, sub)


def _one_rank_group_case(rank, world_size):
    """A group of one rank (not None) runs its collectives: the gathers are pending after the step until a forward
    pre-hook completes them, and the gradient buckets are reduced asynchronously from the backward's hooks."""
    import torch.distributed as dist

    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.training.param_gather import ParamGather

    group = dist.new_group([0])
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    layout = ShardLayout([p.numel() for p in params], dp=1, bucket_size=10)
    gather = ParamGather(params, layout, group, overlap=True)
    gather.hook_modules([model])
    shard = torch.arange(layout.shard_size, dtype=torch.float32)
    gather.publish(shard)
    pending = gather.pending
    x = torch.ones(3, 4)
    model(x).sum().backward()  # the pre-hooks complete the gathers before each layer reads its weights
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    state = ParallelState.serial()
    state.dp_group = group
    model.zero_grad(set_to_none=True)
    sync = GradSync(params, state, bucket_size=10, overlap=True)
    sync.zero()
    sync.begin(1)
    model(x).sum().backward()
    launched = [b.handle is not None for b in sync.buckets]
    sync.finish()
    grads = [p.main_grad.clone() for p in params]
    sync.remove_hooks()
    model(x).sum().backward()
    same = all(torch.equal(g, p.grad) for g, p in zip(grads, params))
    gather.remove_hooks()
    dist.destroy_process_group(group)
    return pending, flat.tolist() == shard.tolist(), launched, same


@pytest.mark.slow
def test_a_one_rank_group_runs_the_asynchronous_gather_and_reduction():
    pending, gathered, launched, same = run_distributed(1, _one_rank_group_case)[0]
    assert pending and gathered
    assert len(launched) > 1 and all(launched) and same
