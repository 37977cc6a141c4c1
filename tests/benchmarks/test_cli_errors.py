"""Every benchmark's bad input is one `error:` line and exit code 2, found before any work (no rank, no tool, no
search starts: each case here fails while the arguments are checked)."""

import importlib
import sys

import pytest

MISSING = "{tmp}/no/such/folder/out.json"  # an output file in a folder that does not exist
FILE = "{tmp}/a_file"  # an existing file, given where a folder is expected

CASES = [
    ("zero_bubble", ["--pp", "1"], "--pp 1: a pipeline needs at least 2 ranks"),
    ("zero_bubble", ["--iters", "0"], "argument --iters: must be >= 1, got 0"),
    ("zero_bubble", ["--warmup", "-1"], "argument --warmup: must be >= 0, got -1"),
    ("zero_bubble", ["--micro-batch-size", "0"], "argument --micro-batch-size: must be >= 1"),
    ("zero_bubble", ["--p2p-reps", "0"], "argument --p2p-reps: must be >= 1"),
    ("zero_bubble", ["--tolerance", "0.5"], "--tolerance 0.5: must be >= 1"),
    ("zero_bubble", ["--hidden", "100"], "--hidden 100: not divisible by --heads 8"),
    ("zero_bubble", ["--json", MISSING], "does not exist"),
    ("zero_bubble", ["--pp", "4", "--layers", "7"], "--layers 7: fewer than the 8 pipeline stages (zbv: two per rank"),
    ("zero_bubble", ["--pp", "4", "--layers", "3", "--ours", "1f1b", "--torch", ""],
     "--layers 3: fewer than the 4 pipeline stages (--pp 4)"),
    ("pipeline_engine", ["--iters", "0"], "argument --iters: must be >= 1"),
    ("pipeline_engine", ["--warmup", "-1"], "argument --warmup: must be >= 0"),
    ("pipeline_engine", ["--stage-reps", "0"], "argument --stage-reps: must be >= 1"),
    ("pipeline_engine", ["--layers", "0"], "argument --layers: must be >= 1"),
    ("pipeline_engine", ["--layers", "1"], "--layers 1: fewer than the 2 pipeline stages"),
    ("pipeline_engine", ["--trace", "{tmp}"], "is a directory"),
    ("pipeline_engine", ["--trace", "{tmp}/t.json", "--breakdown", "0"], "--trace: traces the --breakdown"),
    ("slicing", ["--micro-batch-size", "3"], "--microbatch-slicing needs an even --micro-batch-size >= 2"),
    ("slicing", ["--micro-batch-size", "1"], "--microbatch-slicing needs an even --micro-batch-size >= 2"),
    ("slicing", ["--iters", "0"], "argument --iters: must be >= 1"),
    ("slicing", ["--pp", "0"], "argument --pp: must be >= 1"),
    ("slicing", ["--hidden", "6"], "--hidden 6: must be a multiple of the model's 4 attention heads"),
    ("bpipe_memory", ["--iters", "0"], "argument --iters: must be >= 1"),
    ("bpipe_memory", ["--hidden", "0"], "argument --hidden: must be >= 1"),
    ("bpipe_memory", ["--seq", "0"], "argument --seq: must be >= 1"),
    ("bpipe_memory", ["--micro-batch-size", "0"], "argument --micro-batch-size: must be >= 1"),
    ("bpipe_memory", ["--pp", "4", "0"], "argument --pp: must be >= 1"),
    ("bpipe_memory", ["--microbatches", "8", "-1"], "argument --microbatches: must be >= 1"),
    ("recompute_overhead", ["--repeats", "0"], "argument --repeats: must be >= 1"),
    ("recompute_overhead", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("recompute_overhead", ["--hidden", "0"], "argument --hidden: must be >= 1"),
    ("recompute_overhead", ["--seq", "-1"], "argument --seq: must be >= 1"),
    ("recompute_overhead", ["--hidden", "15"], "--hidden 15: must be even"),
    ("elastic_restart", ["--repeats", "0"], "argument --repeats: must be >= 1"),
    ("elastic_restart", ["--kill-at", "60"], "--kill-at 60: must come before the last iteration (--iters 60)"),
    ("elastic_restart", ["--hidden-size", "6"], "--hidden-size 6: must be a multiple of the 4 attention heads"),
    ("elastic_restart", ["--dir", FILE], "exists and is not a directory"),
    ("ckpt_formats", ["--nproc", "0"], "argument --nproc: must be >= 1"),
    ("ckpt_formats", ["--num-layers", "0"], "argument --num-layers: must be >= 1"),
    ("ckpt_formats", ["--hidden-size", "32"], "argument --hidden-size: must be >= 64"),
    ("ckpt_formats", ["--nproc", "3"], "--nproc 3: must divide the 16 attention heads"),
    ("ckpt_formats", ["--dir", FILE], "exists and is not a directory"),
    ("simulator_accuracy", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("simulator_accuracy", ["--per-round", "0"], "argument --per-round: must be >= 1"),
    ("simulator_accuracy", ["--profile-repeats", "0"], "argument --profile-repeats: must be >= 1"),
    ("simulator_accuracy", ["--warmup", "-1"], "argument --warmup: must be >= 0"),
    ("simulator_accuracy", ["--tolerance", "0.9"], "--tolerance 0.9: must be >= 1"),
    ("simulator_accuracy", ["--json", "{tmp}"], "--json {tmp}: is a directory"),
    ("simulator_accuracy", ["--save-profile", MISSING], "--save-profile"),
    ("simulator_accuracy", ["--trace-dir", FILE], "--trace-dir"),
    ("simulator_accuracy", ["--profile", "{tmp}/p.json", "--save-profile", "{tmp}/q.json"], "--save-profile: saves"),
    ("simulator_accuracy", ["--profile", "{tmp}/none.json"], "--profile {tmp}/none.json: no such file"),
    ("hybrid_vs_uniform", ["--modelled-only", "--measured-only"], "--modelled-only, --measured-only"),
    ("hybrid_vs_uniform", ["--modelled-only", "--predict-only"], "--predict-only"),
    ("hybrid_vs_uniform", ["--modelled-only", "--json", "{tmp}/h.json"], "--json: holds (b)'s"),
    ("hybrid_vs_uniform", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("hybrid_vs_uniform", ["--trial-iters", "0"], "argument --trial-iters: must be >= 1"),
    ("hybrid_vs_uniform", ["--warmup-iters", "-1"], "argument --warmup-iters: must be >= 0"),
    ("hybrid_vs_uniform", ["--warmup-iters", "10"], "--warmup-iters 10 leaves no measured iteration"),
    ("hybrid_vs_uniform", ["--vocab-size", "0"], "argument --vocab-size: must be >= 1"),
    ("hybrid_vs_uniform", ["--json", MISSING], "does not exist"),
    ("hybrid_vs_uniform", ["--out", FILE], "--out {tmp}/a_file: exists and is not a directory"),
    ("search_vs_grid", ["--grid-passes", "0"], "argument --grid-passes: must be >= 1"),
    ("search_vs_grid", ["--confirm-rounds", "-1"], "argument --confirm-rounds: must be >= 0"),
    ("search_vs_grid", ["--confirm-top", "0"], "argument --confirm-top: must be >= 1"),
    ("search_vs_grid", ["--trial-iters", "0"], "argument --trial-iters: must be >= 1"),
    ("search_vs_grid", ["--warmup-iters", "-1"], "argument --warmup-iters: must be >= 0"),
    ("search_vs_grid", ["--json", "{tmp}"], "is a directory"),
    ("search_vs_grid", ["--out", FILE], "--out"),
    ("tune_vs_grid", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("tune_vs_grid", ["--top-k", "0"], "argument --top-k: must be >= 1"),
    ("tune_vs_grid", ["--warmup-iters", "12"], "--warmup-iters 12 leaves no measured iteration"),
    ("tune_vs_grid", ["--json", MISSING], "--json"),
    ("tune_vs_grid", ["--out", FILE], "--out"),
    ("search_speed", ["--cases", "nosuch"], "--cases: unknown nosuch"),
    ("search_speed", ["--cases", ","], "--cases: unknown empty list"),
    ("search_speed", ["--repeats", "0"], "argument --repeats: must be >= 1"),
    ("search_speed", ["--dump", MISSING], "--dump"),
    ("megatron_sc21", ["--rows", "abc"], "--rows: unknown abc"),
    ("megatron_sc21", ["--zero-bubble", "--dropout", "1"], "--dropout 1.0: must be in [0, 1)"),
    ("megatron_sc21", ["--zero-bubble", "--dropout", "-0.1"], "must be in [0, 1)"),
    ("megatron_sc21", ["--dropout", "0"], "--dropout: only with --zero-bubble"),
    ("megatron_sc21", ["--memory", "--engine", "megatron_bmw"], "--engine: only for the published rows' table"),
    ("megatron_sc21", ["--json", MISSING], "does not exist"),
    ("megatron_core_scaling", ["--rows", "3B"], "--rows: unknown 3B"),
    ("megatron_core_scaling", ["--json", MISSING], "does not exist"),
    ("bloom_trials", ["--group", "nosuch"], "--group 'nosuch': no such group"),
    ("bloom_trials", ["--json", "{tmp}"], "is a directory"),
    ("amp_trials", ["--json", MISSING], "does not exist"),
    ("megatron_core_peer", ["--iters", "0"], "argument --iters: must be >= 1"),
    ("megatron_core_peer", ["--warmup", "-1"], "argument --warmup: must be >= 0"),
    ("megatron_core_peer", ["--timeout-s", "0"], "--timeout-s 0.0: must be > 0"),
    ("megatron_core_peer", ["--json", "{tmp}"], "is a directory"),
    ("kernel_model", ["--repeats", "0"], "argument --repeats: must be >= 1"),
    ("kernel_model", ["--models", "gpt5"], "--models: unknown gpt5"),
    ("kernel_model", ["--device", "nosuch"], "--device nosuch: not a device"),
    ("kernel_model", ["--json", MISSING], "does not exist"),
    ("moe_vs_dense", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("moe_vs_dense", ["--ranks", "0"], "argument --ranks: must be >= 1"),
    ("moe_vs_dense", ["--hidden", "100", "--heads", "3"], "--hidden 100: not divisible by --heads 3"),
    ("moe_vs_dense", ["--topk", "9"], "--topk 9: more than the 8 experts"),
    ("moe_vs_dense", ["--ranks", "1", "3"], "--ranks 3: does not divide the 8 experts"),
    ("moe_vs_dense", ["--json", MISSING], "does not exist"),
    ("moe_planner_vs_grid", ["--rounds", "0"], "argument --rounds: must be >= 1"),
    ("moe_planner_vs_grid", ["--trial-iters", "0"], "argument --trial-iters: must be >= 1"),
    ("moe_planner_vs_grid", ["--warmup-iters", "8"], "--warmup-iters 8 leaves no measured iteration"),
    ("moe_planner_vs_grid", ["--predict-only", "--json", "{tmp}/m.json"], "--json: holds measured times"),
    ("moe_planner_vs_grid", ["--json", MISSING], "does not exist"),
    ("moe_planner_vs_grid", ["--out", FILE], "--out {tmp}/a_file: exists and is not a directory"),
    ("wgrad_fusion", ["--hidden", "0"], "argument --hidden: must be >= 1"),
    ("wgrad_fusion", ["--hidden", "129"], "--hidden 129: not divisible by its 2 attention heads"),
    ("wgrad_fusion", ["--device", "nosuch"], "--device nosuch: not a device"),
]
TAKES_ARGV = {"zero_bubble", "pipeline_engine", "megatron_core_peer", "megatron_core_scaling", "kernel_model",
              "wgrad_fusion", "moe_vs_dense"}


@pytest.mark.parametrize("name, args, message", CASES, ids=[f"{n}:{' '.join(a)}" for n, a, _ in CASES])
def test_bad_input_is_one_line_and_exit_code_2(name, args, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "a_file").write_text("")
    args = [a.format(tmp=tmp_path) for a in args]
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        if name in TAKES_ARGV:
            module.main(args)
        else:
            monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
            module.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert len(err) == 1 and err[0].startswith("error: ") and message.format(tmp=tmp_path) in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written or made before the refusal


def test_help_shows_the_whole_first_paragraph(capsys):
    from benchmarks import pipeline_engine

    with pytest.raises(SystemExit) as exit_info:
        pipeline_engine.parse_args(["--help"])
    assert exit_info.value.code == 0
    assert "Schedule1F1B (issue 3)." in " ".join(capsys.readouterr().out.split())
