"""The run schema: every flag is declared once, on the field it sets; the parser, the range checks and the plan
file's codec all read the declarations."""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import pytest

from megatron_bmw.arguments import FLAG_CLASSES, build_parser, parse_args, run_config_from_argv
from megatron_bmw.config import ModelConfig, PipelineConfig, TrainConfig
from megatron_bmw.config.codec import check_section, to_data
from megatron_bmw.config.planner import PlannerConfig
from megatron_bmw.config.schema import add_flags, check_ranges, declared, flag, from_flags
from megatron_bmw.errors import UsageError
from megatron_bmw.planner_args import build_autoconfig_parser

BASE = ["--mock-data", "--vocab-size", "128", "--global-batch-size", "8", "--train-iters", "2"]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")]


def test_every_flag_is_declared_once():
    names = [n for cls in (*FLAG_CLASSES, PlannerConfig) for _, fl in declared(cls) for n in fl.names]
    twice = sorted(n for n, c in Counter(names).items() if c > 1)
    assert twice == [], f"flags declared more than once: {twice}"
    # and the training parser offers exactly the declared flags
    gpt = set(_options(build_parser()))
    bert = set(_options(build_parser(model_type="bert")))
    declared_flags = {n for cls in FLAG_CLASSES for _, fl in declared(cls) for n in fl.names}
    assert gpt | bert == declared_flags


def test_every_flag_lands_in_its_own_dest():
    """Two flags parsed into one dest overwrite each other (--moe-ffn-hidden-size once replaced --ffn-hidden-size)."""
    by_dest: dict[str, list[str]] = {}
    for cls in FLAG_CLASSES:
        for f, fl in declared(cls):
            if fl.names:
                by_dest.setdefault(fl.dest or f.name, []).append(fl.action)
    # one dest for a switch's on and off flags (--bert-binary-head, --bert-no-binary-head) is the one way to share
    shared = [d for d, actions in by_dest.items() if len(actions) > 1 and sorted(actions) != ["store_false",
                                                                                              "store_true"]]
    assert shared == []
    run = run_config_from_argv([*BASE, "--num-experts", "4", "--ffn-hidden-size", "48", "--moe-ffn-hidden-size",
                                "16"], 1).run
    assert (run.model.ffn_hidden_size, run.model.moe.ffn_hidden_size) == (48, 16)


def test_micro_batch_size_lands_on_its_one_field():
    owners = [(cls.__name__, f.name) for cls in FLAG_CLASSES for f, fl in declared(cls) if "--micro-batch-size" in fl.names]
    assert owners == [("PipelineConfig", "micro_batch_size")]
    run = run_config_from_argv([*BASE, "--micro-batch-size", "4"], 1).run
    assert run.pipeline.micro_batch_size == 4 and run.pipeline.num_microbatches == 2


@pytest.mark.parametrize("cls", [TrainConfig, PipelineConfig, ModelConfig])
def test_parsed_flags_land_on_the_fields_they_declare(cls):
    """A non-default value given for each switch of `cls` reaches its field by name."""
    for f, fl in declared(cls):
        if fl.action not in ("store_true", "store_false") or fl.group == "bert":
            continue
        run = run_config_from_argv([*BASE, fl.name], 1).run
        part = {TrainConfig: run.train, PipelineConfig: run.pipeline, ModelConfig: run.model}[cls]
        if cls is PipelineConfig and f.name == "bpipe":
            continue  # needs a pipeline
        if cls is TrainConfig and f.name in ("record_memory_history",):
            continue  # needs a GPU at start-up, not at parse time
        assert getattr(part, f.name) is (fl.action == "store_true"), (fl.name, f.name)


def test_ranges_are_checked_from_the_declarations():
    with pytest.raises(UsageError, match=r"^--hidden-dropout must be in \[0, 1\), got 1.0$"):
        ModelConfig(hidden_dropout=1.0)
    with pytest.raises(UsageError, match=r"^--log-interval must be >= 1, got 0$"):
        run_config_from_argv([*BASE, "--log-interval", "0"], 1)
    with pytest.raises(UsageError, match=r"^vocab_size must be >= 2, got 1$"):
        ModelConfig(vocab_size=1)


@dataclasses.dataclass
class _Toy:
    size: int = flag("--toy-size", group="toy", default=3, minimum=1, help="a size")
    kind: str = flag("--toy-kind", group="toy", default="a", choices=("a", "b"))
    on: bool = flag("--toy-off", group="toy", default=True, action="store_false")
    plain: float = 0.5

    def __post_init__(self) -> None:
        check_ranges(self)


def test_a_declared_class_gets_its_parser_checks_and_codec():
    p = argparse.ArgumentParser()
    add_flags(p, {}, [_Toy])
    toy = from_flags(_Toy, p.parse_args(["--toy-size", "5", "--toy-kind", "b", "--toy-off"]))
    assert toy == _Toy(size=5, kind="b", on=False)
    assert from_flags(_Toy, p.parse_args([])) == _Toy()
    with pytest.raises(UsageError, match="--toy-size must be >= 1, got 0"):
        from_flags(_Toy, p.parse_args(["--toy-size", "0"]))
    assert to_data(toy) == {"size": 5, "kind": "b", "on": False, "plain": 0.5}
    assert check_section(_Toy, {"size": 2}, "f.json", "toy") == {"size": 2}
    for data, needle in (({"size": 0}, "field toy.size must be an integer >= 1, got 0"),
                         ({"size": True}, "field toy.size must be an integer >= 1, got True"),
                         ({"kind": "c"}, "field toy.kind must be one of a, b, got 'c'"),
                         ({"on": "yes"}, "field toy.on must be true or false"),
                         ({"plain": "x"}, "field toy.plain must be a number"),
                         ({"colour": 1}, "unknown toy key 'colour'")):
        with pytest.raises(UsageError, match=needle):
            check_section(_Toy, data, "f.json", "toy")


def test_the_planner_flags_are_generated_from_planner_config():
    args = parse_args(["search", "--cluster", "a100-80g-ib", "--profile", "a.json", "--profile", "b.json",
                       "--world-size", "8", "--engine", "megatron-core"], build_autoconfig_parser())
    planner = from_flags(PlannerConfig, args)
    assert planner == PlannerConfig(cluster="a100-80g-ib", profile=["a.json", "b.json"], world_size=8,
                                    engine="megatron-core")


def test_squared_relu_flag_and_its_conflict_with_swiglu(capsys):
    """--squared-relu lands on ModelConfig.squared_relu (Megatron-LM's flag); with --swiglu a one-line error, exit 2."""
    from megatron_bmw.cli.autoconfig import main

    assert run_config_from_argv([*BASE, "--squared-relu"], 1).run.model.squared_relu
    assert not run_config_from_argv(BASE, 1).run.model.squared_relu
    with pytest.raises(UsageError, match="--squared-relu and --swiglu are two MLP activations"):
        run_config_from_argv([*BASE, "--squared-relu", "--swiglu"], 1)
    argv = ["estimate", "--cluster", "a100-80g-ib", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
            "4", "--seq-length", "32", "--vocab-size", "200", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--squared-relu", "--swiglu"]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and "--squared-relu and --swiglu" in err[0]
