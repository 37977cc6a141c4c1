"""The search space: which values each dimension may take, and the layouts (degrees, micro-batching, schedule)
it contains. `--space DIM=VALUES` restricts a dimension, e.g. `--space tp=1,2 --space bpipe=off`."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache

from ..config import ModelConfig
from ..errors import UsageError
from .engine import OURS
from ..pipeline.generators import CHUNKS, SCHEDULES, generate
from ..pipeline.schedule import Kind

SEARCHED = SCHEDULES
ENGINE_SCHEDULES = {"megatron-core": ("1f1b", "interleaved"), "nemo": ("1f1b", "interleaved"), "deepspeed": ("1f1b",)}
_BOOL = {"on": (True,), "off": (False,), "both": (False, True), "true": (True,), "false": (False,)}
CP_MIN_SEQ = 8192  # shorter sequences are not split by default: cp 1 only
_HELP = (f"tp, cp, pp, dp, mbs, ep, etp (lists of integers; ep and etp for MoE models only: by default ep every power of "
         "two dividing the experts, etp 1 and tp; cp by default 1 below {CP_MIN_SEQ} tokens or with attention dropout, else the "
         "powers of two dividing the world that split the sequence into 2 cp chunks); schedule ({', '.join(SEARCHED)}: zero-bubble ones only where the "
         "simulator says they win under the memory limit); virtual (chunks per rank); "
         "sp, zero1, bpipe, slicing (on, off, both); recompute (none, selective, full: the choices allowed per "
         "unit); recompute-granularity (unit or uniform); partition (unit or layer: where stages may end); strategy "
         "(uniform, hybrid, both: Megatron's one layout for all units, Galvatron-BMW's per-unit strategies, or both)")


@dataclass(frozen=True)
class SearchSpace:
    tp: tuple[int, ...] | None = None  # None: every degree that divides the model and fits in a node
    cp: tuple[int, ...] | None = None  # None: cp_degrees' default (1 below CP_MIN_SEQ tokens)
    pp: tuple[int, ...] | None = None
    dp: tuple[int, ...] | None = None
    mbs: tuple[int, ...] | None = None  # None: every divisor of the per-replica batch
    ep: tuple[int, ...] | None = None  # MoE models: None: every power of two dividing the experts (expert_degrees)
    etp: tuple[int, ...] | None = None  # MoE models: None: 1 and tp
    schedule: tuple[str, ...] = ("1f1b", "interleaved", "zb-2p", "zbv")  # gpipe, zb-h1, zb-h2, zb-1p: asked for
    virtual: tuple[int, ...] = (2, 3, 4)
    sp: tuple[bool, ...] = (False, True)
    zero1: tuple[bool, ...] = (False, True)
    bpipe: tuple[bool, ...] = (False, True)
    slicing: tuple[bool, ...] = (False, True)
    recompute: tuple[str | None, ...] = (None, "selective", "full")
    per_unit_recompute: bool = True  # else one choice for every transformer unit
    sublayer: bool = True  # stages may end between a layer's attention and MLP units
    strategy: tuple[str, ...] = ("uniform",)  # uniform layouts, Galvatron-BMW's per-unit hybrid ones, or both

    @classmethod
    def parse(cls, items: list[str] | None) -> SearchSpace:
        space = cls()
        for item in items or []:
            if "=" not in item:
                raise UsageError(f"--space {item!r}: expected DIM=VALUES ({_HELP})")
            key, _, text = item.partition("=")
            key = key.strip().lower()
            values = [v.strip().lower() for v in text.split(",") if v.strip()]
            if not values:
                raise UsageError(f"--space {item!r}: no values")
            space = replace(space, **_parse_dim(key, values, item))
        if not space.schedule:
            raise UsageError("--space schedule: no schedule left")
        return space

    def describe(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def for_engine(self, engine: str) -> SearchSpace:
        """This space cut to what `engine` runs (planner/engine.py ENGINES). Ours runs all of it. Megatron-LM runs
        1F1B and interleaved schedules, stages that end at layer boundaries and one recomputation for all layers
        (--recompute-granularity), without BPipe, slicing or per-unit hybrid strategies; DeepSpeed's pipeline
        engine (Megatron-DeepSpeed) runs 1F1B only and no sequence parallelism."""
        if engine == OURS:
            return self
        runs = ENGINE_SCHEDULES[engine]
        schedule = tuple(s for s in self.schedule if s in runs)
        if not schedule:
            raise UsageError(f"--space schedule={','.join(self.schedule)}: engine {engine} runs only "
                             f"{', '.join(runs)}")
        if "uniform" not in self.strategy:
            raise UsageError(f"--space strategy=hybrid: engine {engine} runs one layout for all units (uniform)")
        for name, values, what in (("bpipe", self.bpipe, "BPipe"), ("slicing", self.slicing, "micro-batch slicing")):
            if False not in values:
                raise UsageError(f"--space {name}=on: engine {engine} has no {what}")
        if self.cp is not None and max(self.cp) > 1:
            raise UsageError(f"--space cp={','.join(map(str, self.cp))}: context parallelism is planned for this "
                             f"runtime (--engine megatron_bmw), not engine {engine}")
        sp = self.sp
        if engine == "deepspeed":
            if False not in sp:
                raise UsageError(f"--space sp=on: engine {engine} has no sequence parallelism")
            sp = (False,)
        return replace(self, schedule=schedule, bpipe=(False,), slicing=(False,), per_unit_recompute=False,
                       sublayer=False, strategy=("uniform",), sp=sp, cp=(1,))


def _parse_dim(key: str, values: list[str], item: str) -> dict:
    if key in ("tp", "cp", "pp", "dp", "mbs", "virtual", "ep", "etp"):
        try:
            ints = tuple(int(v) for v in values)
        except ValueError:
            raise UsageError(f"--space {item!r}: {key} takes integers") from None
        if min(ints) < 1:
            raise UsageError(f"--space {item!r}: {key} values must be >= 1")
        return {key: ints}
    if key == "schedule":
        bad = [v for v in values if v not in SCHEDULES]
        if bad:
            raise UsageError(f"--space {item!r}: unknown schedule {bad[0]!r} ({', '.join(SEARCHED)})")
        return {key: tuple(values)}
    if key in ("sp", "zero1", "bpipe", "slicing"):
        if len(values) != 1 or values[0] not in _BOOL:
            raise UsageError(f"--space {item!r}: {key} takes on, off or both")
        return {key: _BOOL[values[0]]}
    if key == "recompute":
        bad = [v for v in values if v not in ("none", "selective", "full")]
        if bad:
            raise UsageError(f"--space {item!r}: unknown recomputation {bad[0]!r} (none, selective, full)")
        return {key: tuple(None if v == "none" else v for v in values)}
    if key == "recompute-granularity":
        if values not in (["unit"], ["uniform"]):
            raise UsageError(f"--space {item!r}: recompute-granularity takes unit or uniform")
        return {"per_unit_recompute": values[0] == "unit"}
    if key == "partition":
        if values not in (["unit"], ["layer"]):
            raise UsageError(f"--space {item!r}: partition takes unit or layer")
        return {"sublayer": values[0] == "unit"}
    if key == "strategy":
        kinds = {"uniform": ("uniform",), "hybrid": ("hybrid",), "both": ("uniform", "hybrid")}
        if len(values) != 1 or values[0] not in kinds:
            raise UsageError(f"--space {item!r}: strategy takes uniform, hybrid or both")
        return {"strategy": kinds[values[0]]}
    raise UsageError(f"--space {item!r}: unknown dimension {key!r} ({_HELP})")


@dataclass(frozen=True)
class Layout:
    """Degrees, micro-batching and schedule of one candidate; the partition and recomputation come later."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int  # per iteration
    schedule: str
    virtual_stages: int = 1
    cp: int = 1  # context-parallel size: world = tp x cp x pp x dp
    ep: int = 1  # expert-parallel size (MoE models; docs/moe.md)
    etp: int | None = None  # expert-tensor-parallel size; None: tp

    @property
    def placement(self) -> str:
        """Where the virtual stages sit (PipelineConfig.placement): "v" for zbv, else round-robin."""
        return "v" if self.schedule == "zbv" else "interleaved"


@lru_cache(maxsize=None)
def zero_bubble(schedule: str) -> bool:
    """Whether `schedule` splits backwards into B and W (its generator emits BACKWARD_WEIGHT): one model chunk
    per rank, or ZB-V's two in a V (Layout.placement); such a schedule runs without BPipe, slicing or per-unit
    strategies (config.py and arguments.py refuse those)."""
    try:
        sched = generate(schedule, 2, 4, CHUNKS.get(schedule, 1))
    except UsageError:
        return False
    return any(a.kind is Kind.BACKWARD_WEIGHT for acts in sched.actions for a in acts)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(model: ModelConfig, gpus_per_node: int, world: int) -> list[int]:
    """Tensor-parallel degrees that split heads, query groups, hidden and FFN and stay in a node (the vocabulary is padded per
    degree)."""
    out = []
    for t in divisors(world):
        if t > gpus_per_node:
            continue
        if not model.splits_over(t):
            continue
        shared = model.moe.shared_expert_intermediate_size if model.moe is not None else None
        if shared is not None and shared % t:  # the shared experts split over tp (run_parts.check_moe)
            continue
        out.append(t)
    return out


def cp_degrees(space: SearchSpace, model: ModelConfig, world: int) -> list[int]:
    """Context-parallel sizes the search tries: the space's, where they split the sequence into 2 cp chunks;
    by default 1 for sequences shorter than CP_MIN_SEQ tokens (splitting them only adds exchanges) or with attention
    dropout (config/layout_rules.py), else every power of two that divides the world and splits the sequence into 2
    cp chunks. Causal GPT models only."""
    if space.cp is not None:
        if model.attention_dropout and any(c > 1 for c in space.cp):
            raise UsageError(f"--space cp={','.join(map(str, space.cp))}: context parallelism needs "
                             "--attention-dropout 0 (the runtime refuses attention dropout across cp ranks)")
        wanted = [c for c in space.cp if c == 1 or (model.model_type == "gpt" and model.seq_length % (2 * c) == 0)]
        return [c for c in wanted if world % c == 0]
    if model.seq_length < CP_MIN_SEQ or model.model_type != "gpt" or model.attention_dropout:
        return [1]
    out, c = [], 1
    while c <= world:
        if world % c == 0 and (c == 1 or model.seq_length % (2 * c) == 0):
            out.append(c)
        c *= 2
    return out


def layouts(space: SearchSpace, model: ModelConfig, world: int, global_batch: int, tps: list[int]) -> list[Layout]:
    """Every (tp, cp, pp, dp, mbs, schedule, virtual, and for MoE models ep, etp) of the space; pipeline stages need
    one unit each at least. Zero-bubble schedules are left out for MoE models (not planned)."""
    if model.moe is None and ((space.ep is not None and space.ep != (1,)) or space.etp is not None):
        raise UsageError("--space ep/etp: the model has no experts (--num-experts); expert parallelism is searched "
                         "for MoE models only")
    out = []
    for tp in tps:
        if space.tp is not None and tp not in space.tp:
            continue
        for cp in cp_degrees(space, model, world):
            if (world // tp) % cp == 0:
                if model.moe is not None and (model.seq_length // cp) % tp:
                    continue  # each tp rank routes its share of a rank's rows (run_parts.check_moe)
                for lay in _degree_layouts(space, model, world // (tp * cp), global_batch, tp, cp):
                    out += expert_layouts(space, model, lay)
    return out


def expert_degrees(space: SearchSpace, model: ModelConfig, tp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs the search tries for `model` at tensor-parallel size `tp`: (1, tp) for a dense model; for an
    MoE one the space's ep (default: every power of two dividing the experts) that divide the experts, and etp (default
    1 and tp) that split the experts' FFN; etp > 1 only without biases (the runtime splits no expert bias over etp:
    run_parts.check_moe)."""
    if model.moe is None:
        return [(1, tp)]
    experts, ffn = model.moe.num_experts, model.moe_ffn_hidden_size
    eps = space.ep if space.ep is not None else [e for e in (2 ** i for i in range(experts.bit_length()))
                                                 if experts % e == 0]
    etps = space.etp if space.etp is not None else sorted({1, tp})
    return [(e, t) for e in eps for t in etps
            if experts % e == 0 and ffn % t == 0 and (t == 1 or not model.add_bias_linear)]


def expert_layouts(space: SearchSpace, model: ModelConfig, lay: Layout) -> list[Layout]:
    """`lay` with each expert layout whose etp x ep divides the stage's tp x cp x dp ranks (Megatron's rule)."""
    if model.moe is None:
        return [lay]
    if zero_bubble(lay.schedule):
        return []
    stage = lay.tp * lay.cp * lay.dp
    return [replace(lay, ep=ep, etp=etp) for ep, etp in expert_degrees(space, model, lay.tp) if stage % (ep * etp) == 0]


def _degree_layouts(space: SearchSpace, model: ModelConfig, ranks: int, global_batch: int, tp: int,
                    cp: int) -> list[Layout]:
    """layouts' (pp, dp, mbs, schedule, virtual) for one tp and cp over their `ranks` = world / (tp cp) replicas."""
    out = []
    most = model.num_units if space.sublayer else model.num_layers  # stages the partition can make
    for pp in divisors(ranks):
        dp = ranks // pp
        if (space.pp is not None and pp not in space.pp) or (space.dp is not None and dp not in space.dp):
            continue
        if pp > most or global_batch % dp:
            continue
        for mbs in divisors(global_batch // dp):
            if space.mbs is not None and mbs not in space.mbs:
                continue
            m = global_batch // (dp * mbs)
            for schedule in space.schedule:
                if schedule == "interleaved":
                    if pp == 1 or m % pp:
                        continue
                    out += [Layout(tp, pp, dp, mbs, m, schedule, v, cp) for v in space.virtual
                            if v > 1 and pp * v <= most]
                elif (schedule == "gpipe" or zero_bubble(schedule)) and pp == 1:
                    continue  # one stage: GPipe and zero-bubble are 1F1B
                elif schedule == "zbv":  # two chunks per rank in a V
                    if 2 * pp <= most:
                        out.append(Layout(tp, pp, dp, mbs, m, schedule, 2, cp))
                elif schedule in ("1f1b", "gpipe") or zero_bubble(schedule):
                    out.append(Layout(tp, pp, dp, mbs, m, schedule, 1, cp))
    return out
