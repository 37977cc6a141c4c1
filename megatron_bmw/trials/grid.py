"""A sweep's trials: a grid of pretrain_gpt.py flags, or plan files, expanded and checked before anything runs.

Grid on the command line: a flag whose value is a comma list is an axis, every other flag goes to every trial:
    --tensor-model-parallel-size 1,2 --micro-batch-size 1,2 --sequence-parallel on,off --mock-data ...
Flags whose own values hold commas (--split, --pipeline-partition, --recompute-units) separate alternatives
with ';'. `none` drops an optional flag from that trial (--recompute-granularity none,full,selective).
Grid file (YAML):
    grid:  {tensor-model-parallel-size: [1, 2], recompute-granularity: [null, full]}
    flags: {num-layers: 4, mock-data: true, data-path: [a_text_document]}
Axes are crossed in the order given (the file's first). A trial's id is a hash of its flags, its world size and
the run-defining part of its plan, so it names the same configuration in every sweep.

Each trial is checked as pretrain_gpt.py would check it (flags parsed, the plan applied, the configs built for
the world size, the schedule generated); one that fails is recorded as infeasible with the reason, not run.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field

from ..arguments import (IGNORED_FLAGS, add_megatron_args, apply_plan, configs_from_args,
                         data_config_from_args, parse_args)
from ..errors import UsageError
from ..pipeline.build import build_schedule

BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "yes": True, "no": False, "1": True,
              "0": False}
NATIVE_COMMA = ("--split", "--pipeline-partition", "--recompute-units")  # alternatives separated by ';'
RUNNER_FLAGS = {"--train-iters": "--trial-iters", "--log-interval": "the sweep (1)", "--plan": "--plans"}
PLAN_KEYS = ("model", "orig_vocab_size", "make_vocab_size_divisible_by", "parallel", "pipeline", "training")


class _CheckParser(argparse.ArgumentParser):
    """pretrain_gpt.py's parser, its errors raised instead of printed."""

    def error(self, message: str):
        raise UsageError(message)


def megatron_parser() -> argparse.ArgumentParser:
    return add_megatron_args(_CheckParser(prog="pretrain_gpt.py", allow_abbrev=False, add_help=False))


def _flag_kinds() -> dict[str, tuple[str, argparse.Action | None]]:
    """Option -> (bool | list | value | ignored0 | ignored1, its action)."""
    out: dict[str, tuple[str, argparse.Action | None]] = {}
    for action in megatron_parser()._actions:
        kind = "bool" if action.nargs == 0 else "list" if action.nargs in ("*", "+") else "value"
        for opt in action.option_strings:
            out[opt] = (kind, action)
    for opt, n in IGNORED_FLAGS.items():
        out[opt] = (f"ignored{n}", None)
    return out


@dataclass
class Trial:
    flags: dict  # "--flag" -> str | True | list[str], in the order given
    world_size: int
    plan: dict | None = None  # the plan file's JSON
    plan_path: str | None = None
    skip_reason: str | None = None  # infeasible: why
    layout: dict = field(default_factory=dict)
    point: dict = field(default_factory=dict)  # this trial's value on every grid axis

    @property
    def id(self) -> str:
        key = {"flags": sorted((k, v) for k, v in self.flags.items()), "world_size": self.world_size,
               "plan": plan_digest(self.plan) if self.plan else None}
        return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]

    def argv(self) -> list[str]:
        """The trial's pretrain_gpt.py flags (without the sweep's --train-iters and --log-interval)."""
        out = ["--plan", self.plan_path] if self.plan_path else []
        for flag, value in self.flags.items():
            out += [flag] if value is True else [flag, *value] if isinstance(value, list) else [flag, value]
        return out

    def label(self) -> str:
        lay = self.layout
        if lay:
            return layout_label(lay)
        shown = self.point or self.flags
        return " ".join(f"{k.lstrip('-')}={'on' if v is True else 'none' if v is None else v}"
                        for k, v in shown.items() if not isinstance(v, list))[:80]


def layout_label(lay: dict) -> str:
    sched = lay["schedule"] + (f"x{lay['virtual']}" if lay.get("virtual", 1) > 1 else "")
    extras = [x for x, on in (("sp", lay.get("sp")), ("zero1", lay.get("zero1")), ("bpipe", lay.get("bpipe")),
                              (f"slice{lay.get('slicing')}", lay.get("slicing"))) if on]
    return (f"tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} mbs{lay['micro_batch_size']} m{lay['num_microbatches']} "
            f"{sched} rc={lay['recompute']}" + "".join(f" {x}" for x in extras))


def plan_digest(plan: dict) -> str:
    """Hash of what a plan runs (not its prediction or provenance)."""
    core = {k: plan.get(k) for k in PLAN_KEYS}
    return hashlib.sha1(json.dumps(core, sort_keys=True).encode()).hexdigest()[:12]


# ---- parsing ------------------------------------------------------------------------------------------------
def _split(flag: str, text: str) -> list[str]:
    sep = ";" if flag in NATIVE_COMMA else ","
    words = [x.strip() for x in text.split(sep)]
    if "" in words:
        raise UsageError(f"{flag} {text!r}: an empty value in the axis (values are separated by '{sep}')")
    return words


def _value(flag: str, kind: str, action, raw) -> object:
    """One value of `flag` as the trial carries it: str, True, list, or None (the flag left out)."""
    if kind == "bool":
        if isinstance(raw, bool):
            return True if raw else None
        word = str(raw).lower()
        if word not in BOOL_WORDS:
            raise UsageError(f"{flag}: expected on/off (or true/false) for a switch, got {raw!r}")
        return True if BOOL_WORDS[word] else None
    if kind == "list":
        return [str(x) for x in (raw if isinstance(raw, list) else str(raw).split())]
    if raw is None:
        return None
    text = str(raw)
    optional = action is not None and action.default is None and flag not in NATIVE_COMMA
    if text.lower() == "none" and optional and "none" not in (action.choices or ()):
        return None
    return text


def parse_flag_tokens(tokens: list[str]) -> tuple[list[tuple[str, list]], dict]:
    """Megatron flags from the command line -> (axes [(flag, values)], flags fixed for every trial)."""
    kinds = _flag_kinds()
    axes: list[tuple[str, list]] = []
    fixed: dict = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--"):
            raise UsageError(f"unexpected argument {token!r}: Megatron flags start with --")
        flag, eq, inline = token.partition("=")
        i += 1
        if flag not in kinds:
            raise UsageError(f"{flag}: not a pretrain_gpt.py flag")
        if flag in RUNNER_FLAGS:
            raise UsageError(f"{flag}: set by the sweep; use {RUNNER_FLAGS[flag]}")
        if flag in fixed or any(a == flag for a, _ in axes):
            raise UsageError(f"{flag} given twice")
        kind, action = kinds[flag]
        if kind in ("bool", "ignored0"):
            nxt = inline if eq else tokens[i] if i < len(tokens) and not tokens[i].startswith("--") else None
            words = None if nxt is None else _split(flag, nxt)
            if words is not None and all(w.lower() in BOOL_WORDS for w in words) and kind == "bool":
                i += 0 if eq else 1
                values = [_value(flag, kind, action, w) for w in words]
            elif eq:
                raise UsageError(f"{flag} is a switch; give it alone or as {flag}=on,off")
            else:
                values = [True]
        elif kind == "list":
            items = [inline] if eq else []
            while i < len(tokens) and not tokens[i].startswith("--"):
                items.append(tokens[i])
                i += 1
            values = [items]
        else:
            if not eq:
                if i >= len(tokens):
                    raise UsageError(f"{flag} needs a value")
                inline = tokens[i]
                i += 1
            values = [inline] if kind == "ignored1" else [_value(flag, kind, action, v) for v in _split(flag, inline)]
        if len(values) > 1:
            axes.append((flag, values))
        elif values[0] is not None:
            fixed[flag] = values[0]
    return axes, fixed


def load_grid_file(path: str) -> tuple[list[tuple[str, list]], dict]:
    """A YAML grid: `grid` (flag -> list of values) and `flags` (flag -> value for every trial)."""
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except FileNotFoundError:
        raise UsageError(f"--grid {path}: no such file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"--grid {path}: cannot read it ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or set(data) - {"grid", "flags"}:
        raise UsageError(f"--grid {path}: expected a mapping with 'grid' and 'flags' sections")
    if not data.get("grid") and not data.get("flags"):
        raise UsageError(f"--grid {path}: empty (give flags to vary under 'grid', or fixed ones under 'flags')")
    kinds = _flag_kinds()
    out_axes: list[tuple[str, list]] = []
    fixed: dict = {}
    for section in ("grid", "flags"):
        entries = data.get(section) or {}
        if not isinstance(entries, dict):
            raise UsageError(f"--grid {path}: '{section}' must map flags to values")
        for name, raw in entries.items():
            flag = "--" + str(name).lstrip("-")
            if flag not in kinds or flag in RUNNER_FLAGS:
                raise UsageError(f"--grid {path}: {flag} is not a flag a trial can take")
            kind, action = kinds[flag]
            if section == "grid":
                values = raw if isinstance(raw, list) and kind != "list" else [raw]
                if not values:
                    raise UsageError(f"--grid {path}: the axis {flag} has no values")
                out_axes.append((flag, [_value(flag, kind, action, v) for v in values]))
            else:
                value = _value(flag, kind, action, raw)
                if value is not None:
                    fixed[flag] = value
    return out_axes, fixed


def load_plans(paths: list[str]) -> list[tuple[str, dict]]:
    """(path, plan JSON) for every plan file given, directories read for their *.json files (sorted)."""
    from ..planner.files import read_json
    from ..planner.plan import Plan

    files: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(glob.glob(os.path.join(p, "*.json")))
            if not found:
                raise UsageError(f"--plans {p}: no *.json plan files in the folder")
            files += found
        else:
            files.append(p)
    out = []
    for path in files:
        data = read_json(path, "--plans", "plan file")
        Plan.from_json(data, f"--plans {path}")  # a broken plan stops the sweep before it starts
        out.append((path, data))
    return out


# ---- expansion and checks -----------------------------------------------------------------------------------
def expand(axes: list[tuple[str, list]], fixed: dict, world_size: int | None,
           plans: list[tuple[str, dict]] | None = None) -> list[Trial]:
    """Every combination of the axes (with every plan, when plans are given), each checked."""
    for flag, _ in axes:
        if flag in fixed:
            raise UsageError(f"{flag} is both a grid axis and a fixed flag")
    combos = list(itertools.product(*[values for _, values in axes])) or [()]
    trials = []
    for plan_path, plan in plans or [(None, None)]:
        for combo in combos:
            flags = dict(fixed)
            flags.update({flag: v for (flag, _), v in zip(axes, combo) if v is not None})
            world = world_size
            if plan is not None:
                p = plan["parallel"]
                planned = p["tensor_model_parallel_size"] * p["pipeline_model_parallel_size"] * p["data_parallel_size"]
                world = world or planned
            if world is None:
                raise UsageError("give --nproc-per-node (ranks per trial)")
            trial = Trial(flags=flags, world_size=world, plan=plan, plan_path=plan_path,
                          point={flag: v for (flag, _), v in zip(axes, combo)})
            check_trial(trial)
            trials.append(trial)
    return _unique(trials)


def _unique(trials: list[Trial]) -> list[Trial]:
    seen, out = set(), []
    for t in trials:
        if t.id not in seen:
            seen.add(t.id)
            out.append(t)
    return out


_VOCAB: dict[tuple, int] = {}


def _resolve_vocab(args) -> None:
    """A tokenizer's vocabulary size for --vocab-size (pretrain_gpt.py builds the tokenizer; so do we, once)."""
    if args.vocab_size is not None or not args.tokenizer_type:
        return
    key = (args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
           args.tiktoken_num_special_tokens)
    if key not in _VOCAB:
        from ..data.tokenizers import build_tokenizer

        _VOCAB[key] = build_tokenizer(data_config_from_args(args)).vocab_size
    args.vocab_size = _VOCAB[key]


def check_trial(trial: Trial) -> None:
    """Set trial.layout, or trial.skip_reason when pretrain_gpt.py would refuse the trial."""
    from ..planner.spec import spec_from_run_config

    argv = trial.argv()
    parser = megatron_parser()
    try:
        args = parse_args(argv, parser)
        plan = apply_plan(args, argv, parser) if trial.plan_path else None
        _resolve_vocab(args)
        cfg = configs_from_args(args, trial.world_size, plan=plan)
        spec = spec_from_run_config(cfg, trial.world_size)
        build_schedule(spec.pipeline, spec.pp)
    except UsageError as exc:
        trial.skip_reason = str(exc)
        return
    trial.layout = layout_of(spec)


def layout_of(spec) -> dict:
    pl = spec.pipeline
    rc = [x or "none" for x in pl.unit_recompute(spec.model.num_units)[1:-1]]  # [attn_0, mlp_0, ...]
    kinds = sorted(set(rc)) or ["none"]
    if set(rc[0::2]) == {"selective"} and set(rc[1::2]) == {"none"}:
        kinds = ["selective"]
    return {"tp": spec.tp, "pp": spec.pp, "dp": spec.dp, "micro_batch_size": pl.micro_batch_size,
            "num_microbatches": pl.num_microbatches, "global_batch_size": spec.global_batch_size,
            "seq_length": spec.model.seq_length, "schedule": pl.schedule, "virtual": pl.virtual_stages,
            "sp": spec.sp, "zero1": spec.distributed_optimizer, "bpipe": pl.bpipe, "slicing": pl.slicing,
            "recompute": kinds[0] if len(kinds) == 1 else f"mixed{sum(x != 'none' for x in rc)}",
            "partition": list(pl.partition)}
