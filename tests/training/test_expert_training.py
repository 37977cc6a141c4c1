"""The training side of expert parameters (docs/moe.md) on a toy MoE unit whose parameters carry the attributes:
gradients summed over edp and divided by dp x cp equal the serial model's (overlapped or not), one ZeRO-1 step
(experts sharded over edp) equals the serial step with the same grad norm, torch_dist saves experts as boxes of
their global tensors so a checkpoint of ep2 loads into ep1 and ep4 and continues as the serial run; the legacy
format's refusal; the log line's auxiliary losses."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
import pytest
from torch import nn

from megatron_bmw.config import OptimizerConfig, ParallelConfig
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.training.logging import params_norm
from megatron_bmw.training.optimizer import build_optimizer
from tests.dist_harness import run_distributed

E, H, N = 4, 3, 5  # experts, hidden size, tokens per data-parallel rank
WORLD = 4


def _full(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(H, H, generator=g), "fc.bias": torch.randn(H, generator=g),
            "experts.weight": torch.randn(E, H, H, generator=g) / 2}


def _tokens(step: int) -> torch.Tensor:
    """The global batch of an iteration: WORLD x N tokens."""
    return torch.randn(WORLD * N, H, generator=torch.Generator().manual_seed(100 + step))


class _Gather(torch.autograd.Function):
    """Every ep rank's tokens end to end (the allgather dispatcher); backward: the sum of every rank's gradient of
    this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _ReduceOwn(torch.autograd.Function):
    """The sum over ep ranks of every rank's expert outputs, this rank's rows; backward: every rank's gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts), None


class ToyMoE(nn.Module):
    """fc (dense), then token t of the global batch to expert t % E (each ep rank holds E/ep of them)."""

    def __init__(self, full: dict, state) -> None:
        super().__init__()
        self.state, ep, j = state, state.ep_size, state.ep_rank
        self.fc = nn.Linear(H, H)
        with torch.no_grad():
            self.fc.weight.copy_(full["fc.weight"])
            self.fc.bias.copy_(full["fc.bias"])
        local = E // ep
        self.experts = nn.Module()
        self.experts.weight = nn.Parameter(full["experts.weight"][j * local:(j + 1) * local].clone())
        self.experts.weight.expert_parallel, self.experts.weight.expert_dim = True, 0

    def forward(self, x: torch.Tensor, first_token: int) -> torch.Tensor:
        st, local = self.state, self.experts.weight.shape[0]
        h = self.fc(x)
        if st.ep_size > 1:
            h = _Gather.apply(h, st.ep_group)
            first_token -= st.ep_rank * x.shape[0]  # the gathered rows start at ep rank 0's tokens
        expert = (torch.arange(h.shape[0]) + first_token) % E
        out = torch.zeros_like(h)
        for e in range(local):
            mask = (expert == st.ep_rank * local + e).unsqueeze(1).to(h.dtype)
            out = out + mask * (h @ self.experts.weight[e])
        return _ReduceOwn.apply(out, st.ep_group) if st.ep_size > 1 else out


class Chunk(nn.Module):
    """What torch_dist reads of a model chunk: its units by name."""

    def __init__(self, unit: nn.Module) -> None:
        super().__init__()
        self.units = nn.ModuleDict({"mlp_0": unit})


def _expert_state(ep: int) -> ParallelState:
    """dp = world, experts over ep: etp x ep x edp of Megatron's order (edp_rank = rank // ep)."""
    return ParallelState.build(ParallelConfig(expert_model_parallel_size=ep))


def _backward(unit: ToyMoE, sync: GradSync, step: int, rank: int, world: int) -> None:
    """This rank's micro-batch: its N of the global batch (all of it on one rank), the mean loss over its tokens."""
    n = WORLD * N // world
    sync.zero()
    sync.begin(1)
    y = unit(_tokens(step)[rank * n:(rank + 1) * n], rank * n)
    y.square().sum(-1).mean().backward()
    sync.finish()


def _named(unit: ToyMoE) -> list:
    return [("fc.weight", unit.fc.weight), ("fc.bias", unit.fc.bias), ("experts.weight", unit.experts.weight)]


def _cfg(zero: bool, overlap_gather: bool = False) -> OptimizerConfig:
    return OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.5, use_distributed_optimizer=zero,
                           overlap_param_gather=overlap_gather, param_bucket_size=7)


def _serial(steps: int) -> tuple[list[dict], list[dict], list[float]]:
    """(gradients, parameters after each step, grad norms) of the serial model."""
    state = ParallelState.serial()
    unit = ToyMoE(_full(), state)
    sync = GradSync(list(unit.parameters()), state)
    opt = build_optimizer(_named(unit), _cfg(False), state)
    grads, params, norms = [], [], []
    for step in range(steps):
        _backward(unit, sync, step, 0, 1)
        grads.append({n: p.main_grad.clone() for n, p in _named(unit)})
        norms.append(opt.step().grad_norm)
        params.append({n: p.detach().clone() for n, p in _named(unit)})
    return grads, params, norms


def _local(full: dict, state) -> dict:
    """This ep rank's part of full tensors."""
    local = E // state.ep_size
    return {n: t[state.ep_rank * local:(state.ep_rank + 1) * local] if n.startswith("experts") else t
            for n, t in full.items()}


def _steps_case(rank, world, ep, zero, overlap, steps):
    state = _expert_state(ep)
    unit = ToyMoE(_full(), state)
    sync = GradSync(list(unit.parameters()), state, bucket_size=5, overlap=overlap)
    opt = build_optimizer(_named(unit), _cfg(zero, overlap and zero), state, modules=[unit])
    grads, params, norms = [], [], []
    for step in range(steps):
        _backward(unit, sync, step, rank, world)
        grads.append({n: p.main_grad.clone() for n, p in _named(unit)})
        norms.append(opt.step().grad_norm)
        opt.finish_param_sync()
        params.append({n: p.detach().clone() for n, p in _named(unit)})
    buckets = [(b.group is state.edp_group, [id(p) == id(unit.experts.weight) for p in b.params])
               for b in sync.buckets]
    return grads, params, norms, buckets, (state.ep_rank, state.ep_size), params_norm(_named(unit), state)


def _check_against_serial(results, steps: int) -> None:
    grads, params, norms = _serial(steps)
    serial_params_norm = sum(t.double().square().sum() for t in params[-1].values()) ** 0.5
    for r_grads, r_params, r_norms, _, (ep_rank, ep_size), r_params_norm in results:
        assert r_params_norm == pytest.approx(float(serial_params_norm), rel=1e-6)  # each element once
        shape = type("S", (), {"ep_rank": ep_rank, "ep_size": ep_size})
        for step in range(steps):
            for want, got in ((grads[step], r_grads[step]), (params[step], r_params[step])):
                for name, t in _local(want, shape).items():
                    torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=f"{name}, step {step}")
            assert r_norms[step] == pytest.approx(norms[step], rel=1e-5)


@pytest.mark.slow
def test_expert_gradients_and_steps_equal_the_serial_model():
    """dp4 with experts over ep2 (edp 2) and ep4 (edp 1: nothing to sum, still divided by dp): the synced
    gradients, the grad norm (clipping active), the parameters after each step and the params norm equal the serial
    model's, with
    and without --overlap-grad-reduce and ZeRO-1 (experts sharded over edp, --overlap-param-gather)."""
    cases = [(2, False, False), (2, True, True), (4, True, False), (1, True, True)]
    for ep, zero, overlap in cases:
        results = run_distributed(WORLD, _steps_case, ep, zero, overlap, 2)
        _check_against_serial(results, 2)
        for experts_bucket, members in results[0][3]:
            assert experts_bucket == all(members) or not any(members)  # expert buckets hold experts only


def _save_load_case(rank, world, tmp, save_ep, load_ep):
    """Two steps on ep `save_ep` with ZeRO-1, saved as torch_dist; loaded into ep `load_ep`, which takes a third."""
    from megatron_bmw.training import dist_checkpoint
    from megatron_bmw.training.checkpointer import Checkpointer

    state = _expert_state(save_ep)
    unit = ToyMoE(_full(), state)
    sync = GradSync(list(unit.parameters()), state)
    opt = build_optimizer(_named(unit), _cfg(True), state)
    for step in range(2):
        _backward(unit, sync, step, rank, world)
        opt.step()
    dist_checkpoint.save(tmp, 2, state, {"iteration": 2, "args": {}}, [Chunk(unit)], opt)
    state = _expert_state(load_ep)
    unit = ToyMoE(_full(seed=7), state)  # other weights: the load must replace them
    sync = GradSync(list(unit.parameters()), state)
    opt = build_optimizer(_named(unit), _cfg(load_ep == 4), state)
    Checkpointer(state, [Chunk(unit)], opt).load(tmp)
    loaded = {n: p.detach().clone() for n, p in _named(unit)}
    _backward(unit, sync, 2, rank, world)
    norm = opt.step().grad_norm
    return loaded, {n: p.detach().clone() for n, p in _named(unit)}, norm, (state.ep_rank, state.ep_size)


@pytest.mark.slow
def test_torch_dist_saves_expert_boxes_that_load_into_other_expert_layouts(tmp_path):
    """Saved on ep2 (ZeRO-1 over edp 2), loaded into ep1 (no ZeRO) and ep4 (ZeRO-1 over edp 1): the weights are
    the serial model's after two steps and the third step (masters and Adam moments loaded) equals the serial
    third step."""
    _, params, norms = _serial(3)
    for load_ep in (1, 4):
        where = str(tmp_path / f"ep{load_ep}")
        for loaded, stepped, norm, (ep_rank, ep_size) in run_distributed(WORLD, _save_load_case, where, 2, load_ep):
            shape = type("S", (), {"ep_rank": ep_rank, "ep_size": ep_size})
            for want, got in ((params[1], loaded), (params[2], stepped)):
                for name, t in _local(want, shape).items():
                    torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=f"{name}, ep{load_ep}")
            assert norm == pytest.approx(norms[2], rel=1e-5)


def test_zero1_pieces_of_expert_tensors_tile_the_global_tensor():
    """ZeRO-1 flat ranges of 3-D expert shards (partial rows of partial slabs, whole slabs) with an etp split on
    dim 1 (SwiGLU's stride 2) placed as boxes at ep_rank x local experts: over ep, etp and ranges they tile the
    global [E, rows, h] tensor exactly."""
    from megatron_bmw.parallel.init import shard
    from megatron_bmw.training.dist_chunks import piece_slices, slices_of

    full = torch.arange(4 * 8 * 3, dtype=torch.float32).view(4, 8, 3)
    ep, etp = 2, 2
    rebuilt, whole = torch.full_like(full, -1.0), torch.full_like(full, -1.0)
    for j in range(ep):
        for r in range(etp):
            local = shard(full[j * 2:(j + 1) * 2], 1, r, etp, 2)
            p = nn.Parameter(local.clone())
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 1, 2
            p.expert_parallel, p.expert_dim = True, 0
            s = slices_of(p, local, r, etp, j, ep)
            for off, t in s.chunks:
                whole[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
            for start, end in ((0, 2), (2, 7), (7, 13), (13, local.numel())):
                s = piece_slices(p, start, end, local.reshape(-1)[start:end].clone(), r, etp, j, ep)
                assert tuple(s.size()) == (4, 8, 3)
                for off, t in s.chunks:
                    region = rebuilt[tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                    assert (region == -1).all()  # no overlap
                    region.copy_(t)
    assert torch.equal(rebuilt, full) and torch.equal(whole, full)


def test_legacy_format_refuses_expert_parallelism_naming_torch_dist():
    from megatron_bmw.errors import UsageError
    from megatron_bmw.config.layout_rules import legacy_format_refusal
    from megatron_bmw.training.checkpointing import TorchFormat

    assert legacy_format_refusal(1, 2, 2) is None
    assert legacy_format_refusal(2, 1, 1) == (
        "--ckpt-format torch: experts split by --expert-model-parallel-size 2 are saved and loaded only as "
        "torch_dist; use --ckpt-format torch_dist (it loads into any ep/etp/tp/pp)")
    assert "--expert-tensor-parallel-size 1 (tp 2)" in legacy_format_refusal(1, 1, 2)
    state = ParallelState.serial()
    unit = ToyMoE(_full(), state)
    TorchFormat(state, [Chunk(unit)])  # ep 1: the legacy files hold the experts as dense tensors
    ep2 = SimpleNamespace(ep_size=2, etp_size=1, tp_size=1)
    with pytest.raises(UsageError, match="^--ckpt-format torch: experts split by --expert-model-parallel-size 2"):
        TorchFormat(ep2, [Chunk(unit)])


def test_log_line_shows_the_auxiliary_losses_beside_lm_loss():
    """Megatron's names and format: ` lm loss: X | load_balancing_loss: Y | z_loss: Z |`, means over the
    iterations that stepped."""
    import re

    from megatron_bmw.config import ModelConfig, MoEConfig
    from megatron_bmw.training.logging import IntervalStats, format_train_log
    from megatron_bmw.training.moe_logging import aux_loss_names

    model = ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8, vocab_size=16,
                        moe=MoEConfig(num_experts=4, z_loss_coeff=1e-3))
    assert aux_loss_names(model) == ["load_balancing_loss", "z_loss"]
    assert aux_loss_names(ModelConfig(num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8,
                                      vocab_size=16, moe=MoEConfig(load_balancing_type="seq_aux_loss"))) == \
        ["seq_load_balancing_loss"]
    stats = IntervalStats()
    stats.add(2.0, True, aux={"load_balancing_loss": 1.0, "z_loss": 0.5})
    stats.add(4.0, True, aux={"load_balancing_loss": 3.0, "z_loss": 1.5})
    stats.add(9.0, False, aux={"load_balancing_loss": 9.0, "z_loss": 9.0})  # skipped: not averaged
    line = format_train_log(iteration=3, train_iters=10, consumed_samples=24, elapsed_ms=1.0, learning_rate=1e-4,
                            global_batch_size=8, losses=stats.losses(), loss_scale=1.0)
    fields = dict(re.findall(r" ([a-z_ ]+): ([0-9.E+-]+) \|", line))
    assert " lm loss: 3.000000E+00 | load_balancing_loss: 2.000000E+00 | z_loss: 1.000000E+00 | loss scale:" in line
    assert float(fields["load_balancing_loss"]) == 2.0 and float(fields["lm loss"]) == 3.0
