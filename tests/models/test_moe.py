"""The MoE unit on one process: routing, top-k, capacity and drop rules against a small pure-torch reference
written here, the auxiliary losses against their formulas, the grouped GEMM against a loop, the parameters'
names, shapes and attributes, the start-up checks, and recomputation. (Layouts: tests/pipeline/test_engine_moe.py.)"""

import math

import pytest
import torch

from megatron_bmw.arguments import configs_from_args, parse_args
from megatron_bmw.config import MoEConfig, ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.models import moe_experts
from megatron_bmw.models import moe_routing as routing
from megatron_bmw.models.moe import MoE, drain_aux_losses
from megatron_bmw.run_parts import check_moe
from megatron_bmw.units import unit_kind, unit_kind_of
from tests.reference import LLAMA, make_batch, serial_reference, small_config


def _ref_route(logits, k, pre_softmax=False, sigmoid=False, scale=None):
    """Per token, in plain Python: the k best experts (ties: lowest index) and their probabilities."""
    probs, chosen = torch.zeros_like(logits), torch.zeros_like(logits, dtype=torch.bool)
    for t, row in enumerate(logits.tolist()):
        scores = [1 / (1 + math.exp(-v)) for v in row] if sigmoid else row
        if pre_softmax:
            z = sum(math.exp(v) for v in row)
            scores = [math.exp(v) / z for v in row]
        best = sorted(range(len(row)), key=lambda e: (-scores[e], e))[:k]
        if sigmoid:
            total = sum(scores[e] for e in best) if k > 1 else 1.0
            p = [scores[e] / total for e in best]
        elif pre_softmax:
            p = [scores[e] for e in best]
        else:
            z = sum(math.exp(row[e]) for e in best)
            p = [math.exp(row[e]) / z for e in best]
        for e, v in zip(best, p):
            probs[t, e], chosen[t, e] = v * (scale or 1.0), True
    return probs, chosen


@pytest.mark.parametrize("kw", [dict(), dict(pre_softmax=True), dict(score_function="sigmoid"),
                                dict(score_function="sigmoid", router_topk=1), dict(topk_scaling_factor=2.5),
                                dict(router_topk=3)])
def test_route_matches_the_reference(kw):
    moe = MoEConfig(num_experts=6, **kw)
    logits = torch.randn(20, 6, generator=torch.Generator().manual_seed(3))
    logits[0] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, -1.0])  # a three-way tie: lowest indices win
    probs, chosen = routing.route(logits, moe)
    ref_probs, ref_chosen = _ref_route(logits, moe.router_topk, moe.pre_softmax, moe.score_function == "sigmoid",
                                       moe.topk_scaling_factor)
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(probs, ref_probs)
    assert chosen[0, 1] and (chosen[0, 2] if moe.router_topk > 1 else not chosen[0, 4])


def _ref_keep(probs, chosen, cap, policy, pad):
    """Per expert, in plain Python: the tokens it takes."""
    n, experts = probs.shape
    keep = torch.zeros_like(chosen)
    for e in range(experts):
        if cap >= n:
            keep[:, e] = True if pad else chosen[:, e]
            continue
        if policy == "probs":
            order = sorted(range(n), key=lambda t: (-probs[t, e].item(), t))
        else:
            order = sorted(range(n), key=lambda t: (not chosen[t, e].item(), t))
        for t in order[:cap]:
            keep[t, e] = pad or chosen[t, e]
    return keep


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("factor", [0.5, 1.0, 4.0])
def test_capacity_drops_as_the_reference(policy, pad, factor):
    moe = MoEConfig(num_experts=4, router_topk=2, expert_capacity_factor=factor, token_drop_policy=policy,
                    pad_expert_input_to_capacity=pad)
    logits = torch.randn(10, 4, generator=torch.Generator().manual_seed(5))
    probs, chosen = routing.route(logits, moe)
    cap = routing.capacity(10, moe)
    assert cap == math.ceil(10 * 2 / 4 * factor)
    keep = routing.capacity_keep(probs, chosen, moe)
    assert torch.equal(keep, _ref_keep(probs, chosen, cap, policy, pad))
    if pad and cap < 10:
        assert keep.sum(0).tolist() == [cap] * 4  # every expert takes exactly its capacity
    elif not pad:
        assert (keep.sum(0) <= cap).all() and not (keep & ~chosen).any()


def test_aux_and_z_losses_against_their_formulas():
    g = torch.Generator().manual_seed(7)
    s, b, n_experts, k = 5, 3, 4, 2
    logits = torch.randn(s * b, n_experts, generator=g)
    _, chosen = routing.route(logits, MoEConfig(num_experts=n_experts, router_topk=k))
    scores = torch.softmax(logits, -1)
    t = s * b
    f = chosen.float().sum(0) / (t * k)  # fraction of routed slots per expert
    p = scores.mean(0)  # mean probability per expert
    switch = routing.switch_loss(scores.sum(0), chosen.float().sum(0), t, k)
    assert switch.item() == pytest.approx((n_experts * (f * p).sum()).item(), rel=1e-6)
    per_seq = [n_experts * ((chosen.view(s, b, -1)[:, j].float().sum(0) / (s * k)) *
                            scores.view(s, b, -1)[:, j].mean(0)).sum() for j in range(b)]
    seq = routing.switch_loss(scores.view(s, b, -1).sum(0), chosen.view(s, b, -1).float().sum(0), s, k) / b
    assert seq.item() == pytest.approx(torch.stack(per_seq).mean().item(), rel=1e-6)
    z = routing.z_loss_sum(logits) / t
    assert z.item() == pytest.approx(torch.logsumexp(logits, -1).pow(2).mean().item(), rel=1e-6)


def test_sinkhorn_balances_and_routes_by_it():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(2))
    balanced = routing.sinkhorn(logits)
    torch.testing.assert_close(balanced.sum(0), torch.full((4,), 0.25), rtol=1e-3, atol=1e-3)
    probs, chosen = routing.sinkhorn_route(logits, 1, balanced)
    assert torch.equal(chosen.float().argmax(1), balanced.argmax(1))
    torch.testing.assert_close(probs.sum(1), torch.sigmoid(logits).gather(1, balanced.argmax(1, True))[:, 0])


def test_grouped_gemm_equals_a_loop(monkeypatch):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    counts = torch.tensor([4, 0, 7])
    loop = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    torch.testing.assert_close(moe_experts.grouped_mm(x, w, counts), loop)
    monkeypatch.setattr(moe_experts, "_GROUPED_OK", {("cpu", torch.float32): False})
    torch.testing.assert_close(moe_experts.grouped_mm(x, w, counts), loop)


def _moe_cfg(**kw):
    return small_config(moe=MoEConfig(**{"num_experts": 4, "ffn_hidden_size": 16, **kw}), seq_length=16,
                        **{**LLAMA, "num_layers": 2})


def test_parameters_names_shapes_and_attributes():
    cfg = small_config(moe=MoEConfig(num_experts=4, ffn_hidden_size=16, shared_expert_intermediate_size=24,
                                     shared_expert_gate=True, layer_freq="[0,1]"), seq_length=16)
    _, grads, model = serial_reference(cfg, [make_batch(cfg, 2, 1)])
    assert type(model.units["mlp_0"]).__name__ == "MLP" and isinstance(model.units["mlp_1"], MoE)
    assert [unit_kind_of(cfg, n) for n in ("attn_1", "mlp_0", "mlp_1")] == ["attention", "mlp", "moe"]
    assert unit_kind("mlp_1") == "mlp"
    shapes = {n[len("units.mlp_1."):]: tuple(p.shape) for n, p in model.named_parameters() if ".mlp_1." in n}
    assert shapes == {"post_attention_layernorm.weight": (32,), "post_attention_layernorm.bias": (32,),
                      "router.weight": (4, 32), "experts.fc1.weight": (4, 16, 32), "experts.fc1.bias": (4, 16),
                      "experts.fc2.weight": (4, 32, 16), "experts.fc2.bias": (4, 32),
                      "shared_expert.fc1.weight": (24, 32), "shared_expert.fc1.bias": (24,),
                      "shared_expert.fc2.weight": (32, 24), "shared_expert.fc2.bias": (32,),
                      "shared_expert_gate.weight": (1, 32)}
    experts = model.units["mlp_1"].experts
    assert experts.fc1.weight.expert_parallel and experts.fc1.weight.expert_dim == 0
    assert experts.fc1.weight.partition_dim == 1 and experts.fc2.weight.partition_dim == 2
    assert experts.fc2.bias.partition_dim is None and not experts.fc1.weight.tensor_model_parallel
    assert all(g.abs().sum() > 0 for n, g in grads.items() if ".mlp_1." in n and "bias" not in n)


def test_full_recomputation_equals_and_reports_once():
    cfg = _moe_cfg(aux_loss_coeff=0.01, z_loss_coeff=0.001)
    batch = make_batch(cfg, 2, 4)
    loss, grads, model = serial_reference(cfg, [batch])
    plain = drain_aux_losses([model])
    for unit in model.units.values():
        unit.recompute = "full"
    model.zero_grad()
    again = model(None, batch)
    again.backward()
    assert again.item() == pytest.approx(loss, rel=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-5, atol=1e-7)
    recomputed = drain_aux_losses([model])
    assert recomputed.keys() == plain.keys()
    for name, value in plain.items():
        torch.testing.assert_close(recomputed[name], value)
    assert set(plain) == {"load_balancing_loss", "z_loss"} and plain["z_loss"].dim() == 0


def test_aux_loss_gradient_follows_the_scale():
    cfg = _moe_cfg(aux_loss_coeff=0.5, num_experts=4)
    batch = make_batch(cfg, 2, 4)
    grads = []
    for scale in (1.0, 3.0):
        _, g, model = serial_reference(cfg, [batch])
        unit = model.units["mlp_0"]
        unit.state.aux_loss_scale = scale
        model.zero_grad()
        unit.eval()
        with torch.no_grad():
            assert drain_aux_losses([model]) != {} and (model(None, batch), drain_aux_losses([model]))[1] == {}
        unit.train()
        model(None, batch).backward()
        grads.append(model.units["mlp_0"].router.weight.grad.clone())
    _, plain, _ = serial_reference(small_config(**{**LLAMA, "num_layers": 2, "seq_length": 16,
                                                   "moe": MoEConfig(num_experts=4, ffn_hidden_size=16)}), [batch])
    lm = plain["units.mlp_0.router.weight"]
    torch.testing.assert_close(grads[1] - lm, 3.0 * (grads[0] - lm), rtol=1e-4, atol=1e-7)


BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--make-vocab-size-divisible-by", "4"]


@pytest.mark.parametrize("extra,world,needle", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "does not divide --num-experts 6"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "6", "--expert-tensor-parallel-size", "4",
      "--disable-bias-linear"], 4, "does not divide the experts' FFN size 6"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--expert-tensor-parallel-size", "1"], 6, "must divide a pipeline stage's"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "experts split over etp have no biases"),
    (["--expert-model-parallel-size", "2"], 2, "needs --num-experts"),
])
def test_start_up_refusals(extra, world, needle):
    with pytest.raises(UsageError, match=needle):
        configs_from_args(parse_args(BASE + extra), world)


def test_start_up_accepts_moe_layouts():
    run = configs_from_args(parse_args(BASE + ["--num-experts", "4", "--expert-model-parallel-size", "2",
                                               "--moe-token-dispatcher-type", "alltoall", "--context-parallel-size",
                                               "2", "--attention-dropout", "0", "--moe-grouped-gemm"]), 4)
    assert run.model.moe.num_experts == 4 and run.parallel.expert_model_parallel_size == 2
    bert = small_config(model_type="bert", moe=MoEConfig(num_experts=2))
    with pytest.raises(UsageError, match="built for GPT models"):
        check_moe(bert, ParallelConfig())
    with pytest.raises(UsageError, match="--unit-strategies"):
        check_moe(_moe_cfg(), ParallelConfig(unit_strategies=("dp1",) * 6))
