"""pretrain_gpt with per-unit hybrid strategies (--unit-strategies, or a plan's parallel.unit_strategies): losses
and grad norms equal a uniform data-parallel run over several optimizer steps, exact resume (with dropout), a
checkpoint of another plan refused, bad input refused in one line."""

import contextlib
import io
import os

import pytest

from megatron_bmw.errors import Reported
from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import BASE, _cli

# vocabulary 128: no padding at any tp; dropout off so that every layout computes the same numbers
ARGS = BASE + ["--vocab-size", "128", "--hidden-dropout", "0", "--attention-dropout", "0", "--train-iters", "3"]
UNTIED = ["--untie-embeddings-and-output-weights"]
PP1 = "tp4,tp2-dp2,sdp4,dp2-tp2,dp4,tp2-dp2"  # 4 ranks, one stage: every kind of unit strategy
PP2 = "tp2,dp2,sdp2,tp2,dp2,tp2"  # 4 ranks, two stages of 2; tied embedding: the same strategy at both ends


def _train(argv):
    from megatron_bmw.training.logging import num_zeros_in_grad, params_norm

    trainer = build_trainer(argv)
    trainer.train()
    trainer.finish()
    # after the last step: the norm of the parameters and the zeros of the gradients, each element once
    end = (params_norm(trainer.named_params, trainer.state), num_zeros_in_grad(trainer.named_params, trainer.state))
    return [(it, loss, norm) for it, loss, norm in trainer.history] + [end]


def _refused(argv) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(Reported):
        build_trainer(argv)
    return err.getvalue()


def _plan(path, world):
    from megatron_bmw.config import ModelConfig, PipelineConfig
    from megatron_bmw.planner.plan import Plan
    from megatron_bmw.planner.spec import RunSpec

    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                        attention_backend="unfused", untie_embeddings_and_output_weights=True)
    spec = RunSpec.of(model=model, tp=1, pp=1, dp=world, pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=1),
                   unit_strategies=tuple(PP1.split(",")))
    Plan(spec=spec, global_batch_size=8, orig_vocab_size=128, make_vocab_size_divisible_by=4).save(path)


def _cases(rank, world_size, tmp):
    from megatron_bmw.training.pretrain import pretrain

    out = {
        "dp4": _train(ARGS + UNTIED),
        "hybrid-pp1": _train(ARGS + UNTIED + ["--unit-strategies", PP1]),
        "pp2-dp2": _train(ARGS + ["--pipeline-model-parallel-size", "2"]),
        "hybrid-pp2": _train(ARGS + ["--pipeline-model-parallel-size", "2", "--unit-strategies", PP2,
                                     "--recompute-granularity", "full", "--recompute-method", "uniform"]),
    }
    # exact resume: 3 iterations, against 2 saved + 1 loaded (sharded units' local shards and their Adam state)
    ckpt = os.path.join(tmp, "ckpt")
    hybrid = ARGS + UNTIED + ["--unit-strategies", PP1, "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    out["full"] = _train(hybrid)
    out["first"] = _train(hybrid + ["--save", ckpt, "--exit-interval", "2"])
    out["second"] = _train(hybrid + ["--load", ckpt])
    out["other-plan"] = _refused(ARGS + UNTIED + ["--unit-strategies", "dp4", "--load", ckpt])
    out["uniform"] = _refused(ARGS + UNTIED + ["--load", ckpt])
    # a plan file's parallel.unit_strategies runs with --plan
    plan = os.path.join(tmp, "plan.json")
    if rank == 0:
        _plan(plan, world_size)
    import torch.distributed as dist

    dist.barrier()
    trainer = pretrain(["--mock-data", "--plan", plan, "--train-iters", "3", "--lr", "1e-3", "--lr-warmup-iters", "2",
                        "--log-interval", "1", "--eval-iters", "0", "--seed", "1234"])
    out["plan"] = list(trainer.history)
    out["plan-strategies"] = [str(s) for s in trainer.state.units.strategies]
    return out


@pytest.mark.slow
def test_hybrid_pretrain_equals_uniform_and_resumes(tmp_path):
    results = run_distributed(4, _cases, str(tmp_path))
    last = results[-1]
    for hybrid, uniform in (("hybrid-pp1", "dp4"), ("hybrid-pp2", "pp2-dp2"), ("plan", "dp4")):
        assert len(last[hybrid]) == 3 + (hybrid != "plan")
        for (it, loss, norm), (_, ref_loss, ref_norm) in zip(last[hybrid][:3], last[uniform]):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (hybrid, it)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (hybrid, it)
        if hybrid != "plan":
            assert last[hybrid][3][0] == pytest.approx(last[uniform][3][0], rel=1e-6), hybrid  # params norm
            # zeros in the gradients (each element once; an exact zero may come out 1e-12 in another sum order)
            assert abs(last[hybrid][3][1] - last[uniform][3][1]) <= 2, hybrid
    assert [h[0] for h in last["first"][:2]] == [1, 2] and [h[0] for h in last["second"][:1]] == [3]
    resumed = last["first"][:2] + last["second"][:1]
    assert [h[1:] for h in resumed] == [h[1:] for h in last["full"][:3]]  # bit-exact, dropout on
    assert last["second"][1] == last["full"][3]
    assert last["full"][0][1] != last["hybrid-pp1"][0][1]  # dropout did something
    assert all(os.path.isfile(tmp_path / "ckpt" / "iter_0000002" / f"mp_rank_0{i}" / "model_optim_rng.pt")
               for i in range(4))
    err = results[0]["other-plan"]
    assert "saved with unit strategies tp4,tp2-dp2,sdp4,dp2-tp2,dp4,tp2-dp2, but this run uses dp4,dp4" in err
    assert "saved with unit strategies tp4,tp2-dp2" in results[0]["uniform"] and "uniform layout" in results[0]["uniform"]
    assert last["plan-strategies"] == PP1.split(",")


BAD = [
    (["--unit-strategies", "tp2", "--tensor-model-parallel-size", "2"], 4, "cannot be combined with --tensor-model"),
    (["--unit-strategies", "tp2", "--sequence-parallel"], 2, "cannot be combined with --sequence-parallel"),
    (["--unit-strategies", "sdp2", "--use-distributed-optimizer"], 2, "--use-distributed-optimizer"),
    (["--unit-strategies", "tp2"], 4, "spans 2 ranks, but a pipeline stage has 4"),
    (["--unit-strategies", "dp4,dp4"], 4, "2 strategies given, but the model has 6 units"),
    (["--unit-strategies", "tp4,dp4,dp4,dp4,dp4,dp4"], 4, "a tied word embedding needs the same, unsharded"),
    (["--unit-strategies", "sdp4"], 4, "a tied word embedding needs the same, unsharded"),
    (["--unit-strategies", "tp8"], 8, "--num-attention-heads 4 does not split over the tp of tp8"),
    (["--unit-strategies", "tp3"], 3, "--num-attention-heads 4 does not split over the tp of tp3"),
    (["--unit-strategies", "tp2-dq2"], 4, "'tp2-dq2' is not a strategy"),
    (["--unit-strategies", "dp2-tp2", "--vocab-size", "99", "--make-vocab-size-divisible-by", "1"], 4,
     "--unit-strategies dp2-tp2: the padded vocabulary 99 does not split over tp 2"),
    (["--unit-strategies", "tp2,tp2,tp2,dp2,dp2,tp2", "--microbatch-slicing", "1", "--micro-batch-size", "1",
      "--global-batch-size", "4"], 2, "half a stage micro-batch (1 samples) does not split over the dp of dp2"),
]


def test_bad_hybrid_input_refused():
    from megatron_bmw.arguments import build_parser, configs_from_args, parse_args
    from megatron_bmw.errors import UsageError

    for args, world, needle in BAD:
        with pytest.raises(UsageError) as info:
            configs_from_args(parse_args(ARGS + args, build_parser()), world)
        assert needle in str(info.value) and "\n" not in str(info.value), (args, str(info.value))


@pytest.mark.slow
def test_bad_hybrid_input_one_line_exit_2():
    out = _cli(ARGS + ["--unit-strategies", "tp4,dp4,dp4,dp4,dp4,dp4"], {"WORLD_SIZE": "4"})
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --unit-strategies: a tied word embedding"), err
