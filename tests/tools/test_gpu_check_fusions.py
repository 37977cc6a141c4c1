"""tools/gpu_check.py's fusions step without running its trainings: every variant's command line parses into the
kernel choices it names, the GPU sizes fit one H100 by the memory model, and the step's comparison (speed-ups,
MFU, the first loss held to bf16's 1%, the fastest variant) from logged iterations."""

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "tools", "gpu_check.py"))
gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(_spec)  # tools/ is not a package
_spec.loader.exec_module(gpu_check)


def _model(flags):
    from megatron_bmw.arguments import configs_from_args, parse_args

    return configs_from_args(parse_args(flags), 1).model


@pytest.mark.parametrize("sizes", [gpu_check.GPU, gpu_check.DRY], ids=["gpu", "dry"])
def test_every_variant_parses_into_the_kernels_it_names(sizes):
    for label, model, batch in sizes.fusions:
        for name, flags in gpu_check.FUSION_VARIANTS[label]:
            m = _model(gpu_check.fusion_flags(model, batch, flags, sizes.fusion_iters))
            assert m.params_dtype == "bf16"
            assert m.attention_backend == ("fused" if "fused" in flags else "flash"), (label, name)
            assert m.cross_entropy_loss_fusion == ("--cross-entropy-loss-fusion" in flags)
            fused_ops = not set(gpu_check.FUSIONS_OFF) & set(flags)
            assert m.bias_swiglu_fusion == m.apply_rope_fusion == fused_ops
            assert m.swiglu == (label == "llama") and m.position_embedding_type == ("rope" if label == "llama"
                                                                                   else "learned_absolute")


def test_the_gpu_models_fit_one_h100_with_room():
    from megatron_bmw.cli.autoconfig import simulate_flags

    for label, model, batch in gpu_check.GPU.fusions:
        for name, flags in gpu_check.FUSION_VARIANTS[label]:
            ev = simulate_flags(["--cluster", "h100-80g-ib", "--num-nodes", "1", "--world-size", "1",
                                 *model, *batch, "--bf16", *flags])[0]
            peak = max(m.peak_bytes for m in ev.memory)
            assert peak < 0.8 * 80e9, (label, name, peak / 1e9)


class _Fake(gpu_check.Context):
    """pretrain() answers from a table of first losses and ms per iteration instead of training."""

    table: dict = {}

    def pretrain(self, flags, what):
        first, ms = self.table[what]
        its = [{"iteration": i, "lm_loss": first - 0.1 * (i - 1), "elapsed_ms": ms, "throughput_per_gpu_tflop_s_gpu":
                400.0 * 100 / ms} for i in range(1, 7)]
        return {"iterations": its, "plan_check": {}, "log": ""}


def _fake(table):
    ctx = _Fake(out_dir="", work="", python=sys.executable, sizes=gpu_check.DRY, cuda=True, dry_run=True,
                deadline=0.0)
    ctx.table = table
    ctx.env = {"peak_bf16_tflops": 989.0}
    return ctx


def test_the_step_compares_each_variant_with_its_models_baseline():
    table = {"gpt flash run": (10.0, 100.0), "gpt cudnn run": (10.01, 80.0), "gpt ce_fusion run": (10.0, 95.0),
             "llama unfused run": (11.0, 200.0), "llama fused_ops run": (11.0, 160.0), "llama all run": (11.05, 150.0)}
    out = gpu_check.step_fusions(_fake(table))
    n = out["numbers"]
    assert n["gpt_cudnn_speedup"] == 1.25 and n["llama_all_speedup"] == round(200 / 150, 3)
    assert n["gpt_fastest"] == "cudnn" and n["llama_fastest"] == "all"
    assert n["gpt_flash_mfu_pct"] == round(100 * 400 / 989, 1)
    assert set(out["details"]) == {"gpt", "llama"} and len(out["details"]["llama"]) == 3


def test_a_variant_whose_loss_strays_fails_the_step():
    table = {"gpt flash run": (10.0, 100.0), "gpt cudnn run": (10.2, 80.0), "gpt ce_fusion run": (10.0, 95.0),
             "llama unfused run": (11.0, 200.0), "llama fused_ops run": (11.0, 160.0), "llama all run": (11.0, 150.0)}
    with pytest.raises(gpu_check.StepFailed, match=r"gpt cudnn: first loss 10.2000 against 10.0000 \(2.00%"):
        gpu_check.step_fusions(_fake(table))
