"""Mixtures of experts through pretrain_gpt's flags (a tiny Mixtral: Llama layers, 4 experts, top-2, aux and z
losses, fp32, no dropout): the serial run's lm losses, auxiliary losses (as logged) and grad norms on ep2 (dp2)
with ZeRO-1 and overlapped reduce and gather, both dispatchers, ep2 x tp2 + SP, ep2 x pp2 with a stage ending
between attention and the MoE unit, ep4 etp1 beside tp2, cp2 x ep2; the schedules with MoE (interleaved 1F1B,
zb-h1, zbv, BPipe, slicing where its routing allows); a torch_dist checkpoint of ep2 x dp2 resumed into ep4 and
into ep1 x tp2 continues as the uninterrupted run; bad combinations refused in one line."""

import pytest

from megatron_bmw.arguments import build_parser, configs_from_args, parse_args
from megatron_bmw.errors import UsageError
from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import BASE, LLAMA_FLAGS, _layout

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]
DENSE = BASE + LLAMA_FLAGS + ["--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "128"]
MODEL = DENSE + MOE
# load balancing per sequence: linear in the samples, so a micro-batch run as two halves routes as the whole
SEQ_AUX = ["--moe-router-load-balancing-type", "seq_aux_loss"]
A2A, AG = ["--moe-token-dispatcher-type", "alltoall"], ["--moe-token-dispatcher-type", "allgather"]
ZERO1 = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
CUT = ["--pipeline-partition", "2,4"]  # [embedding, attn_0] | [mlp_0, attn_1, mlp_1, head]


def _ep(n, etp=None):
    return ["--expert-model-parallel-size", str(n)] + ([] if etp is None else ["--expert-tensor-parallel-size",
                                                                               str(etp)])


def _train(argv):
    trainer = build_trainer(argv)
    trainer.train()
    trainer.finish()
    return trainer.history, trainer.aux_history


def _runs(rank, world_size, runs):
    return [_train(MODEL + ["--train-iters", "3"] + extra) for extra in runs]


def _same(got, ref, name):
    (hist, aux), (ref_hist, ref_aux) = got, ref
    assert len(hist) == len(ref_hist) == len(aux) == len(ref_aux), name
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref_hist):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
        assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)
    for it, (a, b) in enumerate(zip(aux, ref_aux)):
        assert a.keys() == b.keys(), (name, it)
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5), (name, it, key)


TWO = {
    "ep2-a2a-zero1": _ep(2) + A2A + ZERO1,
    "ep2-allgather": _ep(2) + AG,
    "cp2-ep2": _ep(2) + A2A + ["--context-parallel-size", "2"],
}
FOUR = {
    "ep2-tp2-sp": _ep(2) + A2A + _layout(2, 1) + ["--sequence-parallel"],
    "ep2-tp2-sp-allgather": _ep(2) + AG + _layout(2, 1) + ["--sequence-parallel"],
    "ep2-pp2-cut": _ep(2) + A2A + _layout(1, 2) + CUT,
    "ep4-etp1-tp2": _ep(4, 1) + A2A + _layout(2, 1) + ["--sequence-parallel"],
    "ep4-etp1-tp2-allgather": _ep(4, 1) + AG + _layout(2, 1),
    "interleaved": _ep(2) + A2A + _layout(1, 2) + ["--virtual-pipeline-model-parallel-size", "2",
                                                   "--pipeline-partition", "2,1,1,2"],
    "zb-h1": _ep(2) + A2A + _layout(1, 2) + CUT + ["--pipeline-schedule", "zb-h1"],
    "zbv": _ep(2) + A2A + _layout(1, 2) + ["--pipeline-schedule", "zbv", "--pipeline-partition", "2,1,1,2"],
    "bpipe-pp4": _layout(1, 4) + ["--bpipe", "--pipeline-partition", "1,2,1,2"],
}
SLICED = {"slicing-ep2-pp2": _ep(2) + A2A + _layout(1, 2) + CUT + SEQ_AUX + ["--microbatch-slicing", "2"]}


@pytest.mark.slow
def test_moe_layouts_and_schedules_train_alike():
    serial, serial_seq = run_distributed(1, _runs, [[], SEQ_AUX])[0]
    two = run_distributed(2, _runs, list(TWO.values()))[-1]
    four = run_distributed(4, _runs, list(FOUR.values()) + list(SLICED.values()))[-1]
    for name, got in zip((*TWO, *FOUR), two + four):
        _same(got, serial, name)
    _same(four[-1], serial_seq, "slicing-ep2-pp2")
    assert set(serial[1][0]) == {"load_balancing_loss", "z_loss"}


def _resume(rank, world_size, save_flags, loads, ckpt):
    fmt = ["--ckpt-format", "torch_dist", "--train-iters", "4"]
    _train(MODEL + fmt + save_flags + ["--save", ckpt, "--exit-interval", "2"])
    return [_train(MODEL + fmt + flags + ["--load", ckpt]) for flags in loads]


@pytest.mark.slow
def test_torch_dist_of_ep2_resumes_into_ep4_and_ep1_tp2(tmp_path):
    full = run_distributed(1, _runs, [["--train-iters", "4"]])[0][0]
    ckpt = str(tmp_path / "ckpt")
    resumed = run_distributed(4, _resume, _ep(2) + A2A + ZERO1, [_ep(4) + AG, _layout(2, 1) + ZERO1], ckpt)[-1]
    remaining = (full[0][2:], full[1][2:])
    for name, got in zip(("ep4", "ep1-tp2"), resumed):
        assert [h[0] for h in got[0]] == [3, 4], name
        _same(got, remaining, name)


@pytest.mark.parametrize("world,extra,needle", [
    (4, _ep(4) + ["--num-experts", "6"], "--expert-model-parallel-size 4 does not divide --num-experts 6"),
    (2, _ep(2, 2), "must divide a pipeline stage's tensor x context x data parallel ranks"),
    (4, _ep(2) + _layout(1, 2) + _ep(2, 2)[2:], "must divide a pipeline stage's"),
    (2, ["--num-experts", "2", "--moe-router-topk", "3"], "--moe-router-topk 3 exceeds --num-experts 2"),
    (2, _ep(2) + ["--save", "/tmp/x", "--ckpt-format", "torch"], "--ckpt-format torch: experts split by "
                                                                  "--expert-model-parallel-size 2"),
    (4, _ep(2) + _layout(1, 2) + CUT + ["--microbatch-slicing", "2"], "--microbatch-slicing with --num-experts"),
    (2, ["--unit-strategies", "dp2"], "--unit-strategies"),
])
def test_bad_moe_flags_one_line(world, extra, needle):
    with pytest.raises(UsageError, match=needle):
        configs_from_args(parse_args(MODEL + extra), world)


def test_expert_flags_without_experts_or_on_bert():
    with pytest.raises(UsageError, match="--expert-model-parallel-size 2: needs --num-experts"):
        configs_from_args(parse_args(DENSE + _ep(2)), 2)
    biased = [a for a in MODEL if a != "--disable-bias-linear"] + _layout(2, 1)
    with pytest.raises(UsageError, match="--expert-tensor-parallel-size 2: experts split over etp have no biases"):
        configs_from_args(parse_args(biased), 2)
    bert = BASE + MOE
    with pytest.raises(UsageError, match="--num-experts: mixtures of experts are built for GPT models, not bert"):
        configs_from_args(parse_args(bert, build_parser("pretrain_bert.py", "bert")), 1)


def test_megatron_moe_kernel_flags_accepted():
    """Megatron's MoE kernel and overlap choices are accepted and reported as ignored; --moe-router-dtype fp32 is
    honoured (the router always runs in fp32 here), fp64 refused."""
    kernels = ["--moe-permute-fusion", "--moe-router-fusion", "--moe-use-legacy-grouped-gemm",
               "--moe-shared-expert-overlap"]
    args = parse_args(MODEL + kernels + ["--moe-router-dtype", "fp32", "--moe-grouped-gemm"])
    assert args.ignored_kernel_flags == kernels
    assert configs_from_args(args, 1).model.moe.router_dtype == "fp32"
    with pytest.raises(SystemExit):
        parse_args(MODEL + ["--moe-router-dtype", "fp64"])
