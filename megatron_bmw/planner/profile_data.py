"""The profile file: measured (or analytic) unit times, saved bytes and link speeds, reused by later runs.

JSON layout (format 1):
  {"format": 1, "mode": "measured" | "analytic", "device": {"name", "type", "kind", "threads", "sm_count"},
   "dtype": "fp32",
   "model": {hidden_size, num_attention_heads, ffn_hidden_size, seq_length, vocab_size, attention_backend,
             hidden_dropout, attention_dropout, the layer settings, "moe": {MoEConfig's fields} with experts},
   "units": [{"kind", "tp", "micro_batch_size", "forward_s", "backward_s", "saved_bytes", "unit", "recompute"},
             ...],
   "links": {"p2p": {"bandwidth_Bps", "latency_s"}, "allreduce": {...}},
   "overhead": {"forward_s", "backward_s"},     # per compute action of the engine, beside the units
   "overlap_factor": 1.3,                       # optional: slowdown of overlapped gradient reduction
   "memory_allowance": {"workspace_bytes", "fragmentation"},   # optional: per GPU, and the share on top
   "cuda_memory": {"context_bytes", "nccl_bytes_per_communicator", "allocator_fraction", "samples"},  # optional
   "stream": {"<micro-batch size>": {"depth", "stream_s", "units_s"}, ...},  # optional, tp 1 on a GPU
   "host_memory": {"runtime_bytes", "fraction"},  # optional, a CPU profile
   "optimizer": {"bytes_per_s", "fixed_s"},     # optional, a CPU profile
   "load": {"cores", "start", "end", "seconds", "own"},  # optional: the machine's load while it was measured
   "calibration": {...}}                        # optional: what `autoconfig.py calibrate` fitted it on
"overlap_factor" and "memory_allowance" (written by `autoconfig.py calibrate`) are what search, estimate and
simulate use unless --overlap-factor, --memory-workspace-gb or --memory-fragmentation say otherwise; a profile
without them leaves the defaults (1.3; on CUDA the derived allowance, none on the CPU). Profiles calibrated before
these fields existed carry them only in "calibration" (overlap_factor, memory_workspace_bytes,
memory_fragmentation), which is read the same way. "device.cores": the CPU cores of the profiling machine.
"cuda_memory" (written by `autoconfig.py profile` on a GPU) holds the measured terms of the derived CUDA allowance
(cuda_allowance.py), which replace the modelled ones; "samples" keeps the raw allocator readings.
"stream" (a GPU profile): per micro-batch size, a micro-batch's seconds through embedding, `depth` layers (the
one profiled layer again) and head, micro-batches back to back as a run has them ("stream_s"), beside the sum of
the synchronised unit times for the same ("units_s"). Every unit time of the profile (any tp, recomputed or not)
is taken at stream_s / units_s of its timing (at most 1, interpolated in the micro-batch size: `stream_factor`):
the synchronised timings over-count a run, which overlaps each unit's launches with the kernels before it.
"host_memory" (a CPU profile, training/host_memory.py): what a CPU training process holds beyond the counted
tensors, a fixed part (the runtime's first use) and a fraction of the counted bytes (the C allocator's); a CPU
plan's allowance, as "cuda_memory" gives a GPU's. "optimizer" (a CPU profile, training/optimizer_time.py): the
rate and the fixed part of this machine's optimizer step, which the profile's device type then steps at.
"load" (written by `autoconfig.py profile`): os.getloadavg() at the start and the end of the profiling ("start",
"end": the 1, 5 and 15-minute load averages), its "seconds", the "cores" of the machine and the threads the profiling
itself kept busy ("own"); load_per_core() reads the other work's share of the cores from it, and a plan's check
(training/plan_check.py) names a run whose machine was markedly busier or idler than its profile's.
"device.type" names the cluster device type the profile is for (default: device.name); a unit entry with
"unit" (its index in [embedding, attn_0, mlp_0, ..., head]) times that unit alone (per-layer profiles), one
without times every unit of its kind ("moe": an MoE unit, timed at ep 1 and etp = tp, as the cost model reads it; a
profile without MoE entries leaves an MoE unit to the kernel model). An entry with "recompute" (full, or selective
for attention) times the unit
recomputed: its forward without the saved activations, its backward with the recomputation; entries without it
time the unit as it is.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from ..config import ModelConfig, MoEConfig
from ..errors import UsageError
from ..units import ALL_UNIT_KINDS
from .cluster import DeviceType, Link
from .cuda_allowance import MeasuredCudaMemory
from .files import read_json, write_json
from .flops import cp_tile_flops, unit_forward_flops
from .kernel_time import KernelDevice, shape_ratio

FORMAT = 1
MEASURED_CUDA_KEYS = ("context_bytes", "nccl_bytes_per_communicator", "allocator_fraction")
HOST_MEMORY_KEYS = ("runtime_bytes", "fraction")
OPTIMIZER_KEYS = ("bytes_per_s", "fixed_s")
LOAD_KEYS = ("cores", "start", "end", "seconds", "own")
MODEL_KEYS = ("hidden_size", "num_attention_heads", "ffn_hidden_size", "seq_length", "vocab_size",
              "attention_backend", "hidden_dropout", "attention_dropout")
# the model and layer kind (GPT or BERT, Llama-family settings); a profile written before they existed timed GPT-2
LAYER_DEFAULTS = {"model_type": "gpt", "position_embedding_type": "learned_absolute", "rotary_percent": 1.0,
                  "normalization": "LayerNorm", "swiglu": False, "num_query_groups": None, "add_bias_linear": True,
                  "add_qkv_bias": False, "moe": None}


def model_signature(model: ModelConfig) -> dict:
    """The profiled model's shape; with experts their settings under "moe" (the MoE unit timed holds experts:
    layer_freq "1"; a dense model's signature has no "moe")."""
    out = {k: getattr(model, k) for k in MODEL_KEYS + tuple(LAYER_DEFAULTS)}
    if model.moe is not None:
        out["moe"] = {**model.moe.to_json(), "layer_freq": "1"}
    return out


def load_now() -> list[float] | None:
    """This machine's 1, 5 and 15-minute load averages (runnable and waiting tasks), None where the system gives
    none."""
    try:
        return [round(x, 3) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def load_record(start: list[float] | None, seconds: float, own: float) -> dict | None:
    """The load a measurement ran under (its start reading, this moment's, how long it ran, the threads it kept
    busy itself), None where the system gives no load averages."""
    end = load_now()
    if start is None or end is None:
        return None
    return {"cores": os.cpu_count() or 1, "start": list(start), "end": end, "seconds": round(seconds, 3),
            "own": own}


def load_per_core(record: dict | None) -> float | None:
    """Other work's runnable tasks per core while a measurement ran: the mean of the 1-minute load averages at its
    start and end, less what the measurement's own busy threads added to the end one (a constant load of n raises
    the 1-minute average by n x (1 - exp(-t / 60 s)) in t seconds), over the cores. None without a record."""
    if not record:
        return None
    rise = record.get("own", 0.0) * (1.0 - math.exp(-record.get("seconds", 0.0) / 60.0))
    others = (record["start"][0] + max(0.0, record["end"][0] - rise)) / 2
    return others / record["cores"]


@dataclass
class UnitTiming:
    kind: str
    tp: int
    micro_batch_size: int
    forward_s: float
    backward_s: float
    saved_bytes: int | None = None
    unit: int | None = None  # this unit of the model only (per-layer times)
    recompute: str | None = None  # timed recomputed (full, or selective for attention)


@dataclass
class Profile:
    device: dict
    dtype: str
    model: dict
    units: list[UnitTiming] = field(default_factory=list)
    links: dict = field(default_factory=dict)
    overhead: dict = field(default_factory=dict)
    mode: str = "measured"
    source: str = ""  # the file it was read from
    overlap_factor: float | None = None  # fitted by calibrate; None: the default (CostSettings)
    memory_workspace_bytes: float | None = None  # fitted by calibrate; None: the default (cli.memory_settings)
    memory_fragmentation: float | None = None
    calibration: dict = field(default_factory=dict)  # calibrate's record of the fit (provenance only)
    cuda_memory: dict = field(default_factory=dict)  # measured CUDA allowance terms (profile on a GPU)
    stream: dict = field(default_factory=dict)  # micro-batch size (str) -> {depth, stream_s, units_s} (GPU)
    host_memory: dict = field(default_factory=dict)  # {runtime_bytes, fraction} (CPU)
    optimizer: dict = field(default_factory=dict)  # {bytes_per_s, fixed_s} (CPU)
    machine_load: dict = field(default_factory=dict)  # "load": {cores, start, end, seconds, own} (load_per_core)
    # the runtime's context-parallel core on one cp rank at tp 1 (training/profiler.time_cp_core):
    # cp size (str) -> micro-batch size (str) -> {forward_s, backward_s}
    cp_core: dict = field(default_factory=dict)

    # ---- lookup ------------------------------------------------------------------------------------------------
    def tps(self, kind: str) -> set[int]:
        return {u.tp for u in self.units if u.kind == kind}

    def cores(self) -> int:
        """CPU cores of the machine the profile was measured on (device.cores; older profiles: this machine's)."""
        return int(self.device.get("cores") or os.cpu_count() or 1)

    @property
    def device_type_name(self) -> str:
        return str(self.device.get("type") or self.device.get("name") or "local")

    def unit_time(self, kind: str, tp: int, micro_batch_size: int, model: ModelConfig,
                  index: int | None = None, kernels: KernelDevice | None = None,
                  recompute: str | None = None) -> tuple[float, float] | None:
        """(forward, backward) seconds for `model`'s unit (unit `index` when the profile times units one by one;
        recomputed as `recompute` says), or None when this tp (or recomputation) was not profiled.

        Linear in the micro-batch size between (and beyond) the profiled sizes. When `model` differs from the
        profiled model: rescaled by the kernel model's times of the two shapes where the device's SM count is
        known (`kernels`, or the profile's own device.sm_count), else by FLOPs."""
        points = sorted((u.micro_batch_size, u.forward_s, u.backward_s) for u in self.units
                        if u.kind == kind and u.tp == tp and u.unit == index and u.recompute == recompute)
        if not points and index is not None:
            points = sorted((u.micro_batch_size, u.forward_s, u.backward_s) for u in self.units
                            if u.kind == kind and u.tp == tp and u.unit is None and u.recompute == recompute)
        if not points:
            return None
        profiled = self.model.get("model_type", "gpt")
        if model.model_type != profiled:  # other units (BERT's head, its embedding): no shape rescales them
            raise UsageError(f"--profile {self.source}: timed a {profiled.upper()} model, this is "
                             f"{model.model_type.upper()}; profile it with `autoconfig.py profile --model-type "
                             f"{model.model_type}`")
        fwd, bwd = _interpolate(points, micro_batch_size)
        k = self.stream_factor(micro_batch_size)
        fwd, bwd = fwd * k, bwd * k
        if model_signature(model) != self.model:
            kernels = self.kernel_device(kernels)
            ratio = shape_ratio(kind, model, micro_batch_size, tp, self._model_config(), tp, kernels) \
                if kernels is not None else None
            if ratio is None:
                ours = unit_forward_flops(kind, model, micro_batch_size, tp)
                ratio = (ours / unit_forward_flops(kind, self._model_config(), micro_batch_size, tp),) * 2
            fwd, bwd = fwd * ratio[0], bwd * ratio[1]
        return fwd, bwd

    def cp_core_time(self, model: ModelConfig, micro_batch_size: int, tp: int, cp: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of the context-parallel core of one attention unit on one cp rank, from the
        profile's timing of the runtime's own tiles (None where it timed none): at the profiled cp size nearest
        `cp`, linear in the micro-batch size, rescaled by the tiles' FLOPs (flops.cp_tile_flops) to `model`'s
        shape, `tp` and `cp`."""
        if not self.cp_core:
            return None
        timed = min((int(c) for c in self.cp_core), key=lambda c: (abs(c - cp), c))
        points = sorted((int(b), e["forward_s"], e["backward_s"]) for b, e in self.cp_core[str(timed)].items())
        fwd, bwd = _interpolate(points, micro_batch_size)
        ratio = cp_tile_flops(model, micro_batch_size, tp, cp) / cp_tile_flops(self._model_config(),
                                                                               micro_batch_size, 1, timed)
        return fwd * ratio, bwd * ratio

    def stream_factor(self, micro_batch_size: float) -> float:
        """What a micro-batch streamed through the stack took over the sum of its synchronised unit timings (at
        most 1; linear in the micro-batch size between the recorded sizes, the nearest beyond them): 1 without a
        "stream" record. A GPU's synchronised timing pays the launch, the host's own work and the wait at every
        unit, where a run overlaps them with the kernels of the units before."""
        points = sorted((float(b), min(1.0, e["stream_s"] / e["units_s"])) for b, e in self.stream.items())
        if not points:
            return 1.0
        if micro_batch_size <= points[0][0]:
            return points[0][1]
        for (b0, k0), (b1, k1) in zip(points, points[1:]):
            if micro_batch_size <= b1:
                return k0 + (micro_batch_size - b0) / (b1 - b0) * (k1 - k0)
        return points[-1][1]

    def kernel_device(self, fallback: KernelDevice | None = None) -> KernelDevice | None:
        """The kernel model's device for rescaling this profile's times to other shapes: its own SM count where
        it recorded one (a GPU profile), else `fallback`. Only ratios are taken, so the rate is nominal."""
        sms = self.device.get("sm_count")
        if sms:
            return KernelDevice(1.0, 1.0, int(sms))
        return fallback

    def _model_config(self) -> ModelConfig:
        moe = self.model.get("moe")
        return ModelConfig(num_layers=1, **{**self.model, "moe": MoEConfig(**moe) if moe else None})

    def achieved_flops(self) -> float:
        """FLOP/s the device reached on the profiled MLP units (a mixture of experts': its MoE units, where all its
        layers hold experts) (the best case), for rescaling to other devices."""
        best = 0.0
        for u in self.units:
            if u.kind in ("mlp", "moe") and u.tp == 1 and u.recompute is None:
                flops = unit_forward_flops(u.kind, self._model_config(), u.micro_batch_size) * 3
                best = max(best, flops / ((u.forward_s + u.backward_s) * self.stream_factor(u.micro_batch_size)))
        if best == 0.0:
            raise UsageError("profile has no tp=1 MLP timing to derive the device speed from")
        return best

    def link(self, name: str) -> Link | None:
        spec = self.links.get(name)
        return Link(spec["bandwidth_Bps"], spec["latency_s"]) if spec else None

    def device_type(self, memory_bytes: float) -> DeviceType:
        """The profiled device as a cluster device type, its peak set to what it achieved."""
        flops = self.achieved_flops()
        step = self.optimizer or {}
        return DeviceType(self.device.get("name", "local"), memory_bytes, {self.dtype: flops},
                          optimizer_bytes_per_s=step.get("bytes_per_s"), optimizer_fixed_s=step.get("fixed_s", 0.0))

    # ---- files ---------------------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        data = {"format": FORMAT, "mode": self.mode, "device": self.device, "dtype": self.dtype, "model": self.model,
                "units": [asdict(u) for u in self.units], "links": self.links, "overhead": self.overhead}
        if self.overlap_factor is not None:
            data["overlap_factor"] = self.overlap_factor
        if self.memory_workspace_bytes is not None or self.memory_fragmentation is not None:
            data["memory_allowance"] = {"workspace_bytes": self.memory_workspace_bytes,
                                        "fragmentation": self.memory_fragmentation}
        if self.calibration:
            data["calibration"] = self.calibration
        if self.cuda_memory:
            data["cuda_memory"] = self.cuda_memory
        if self.stream:
            data["stream"] = self.stream
        if self.host_memory:
            data["host_memory"] = self.host_memory
        if self.optimizer:
            data["optimizer"] = self.optimizer
        if self.machine_load:
            data["load"] = self.machine_load
        if self.cp_core:
            data["cp_core"] = self.cp_core
        return data

    def save(self, path: str) -> None:
        write_json(path, self.to_json(), "--output", "profile")

    @classmethod
    def load(cls, path: str) -> Profile:
        profile = cls.from_json(read_json(path, "--profile", "profile"), path)
        profile.source = path
        return profile

    @classmethod
    def from_json(cls, data, where: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise UsageError(f"--profile {where}: not a format-{FORMAT} profile written by autoconfig.py profile")
        try:
            units = [_unit_timing(u, i, where) for i, u in enumerate(data["units"])]
            for key in ("device", "model", "links", "overhead", "calibration", "memory_allowance", "cuda_memory",
                        "stream", "host_memory", "optimizer", "load"):
                if data.get(key) is not None and not isinstance(data[key], dict):
                    raise UsageError(f"--profile {where}: {key} must be a mapping, got {data[key]!r}")
            mode = data.get("mode", "measured")
            if mode not in ("measured", "analytic"):
                raise UsageError(f"--profile {where}: mode must be measured or analytic, got {mode!r}")
            _optional(data["device"].get("memory_bytes"), "device.memory_bytes", where, 1e-300)
            model = data["model"]
            missing = [k for k in MODEL_KEYS if k not in model]
            if missing:
                raise KeyError(missing[0])
            model = {**LAYER_DEFAULTS, **model}
            calibration = data.get("calibration") or {}
            allowance = data.get("memory_allowance") or {}
            overlap = _optional(data.get("overlap_factor", calibration.get("overlap_factor")), "overlap_factor",
                                where, 1.0)
            workspace = _optional(allowance.get("workspace_bytes", calibration.get("memory_workspace_bytes")),
                                  "memory_allowance.workspace_bytes", where, 0.0)
            fragmentation = _optional(allowance.get("fragmentation", calibration.get("memory_fragmentation")),
                                      "memory_allowance.fragmentation", where, 0.0)
            links, overhead = data.get("links", {}), data.get("overhead", {})
            for name, link in links.items():
                if not isinstance(link, dict):
                    raise UsageError(f"--profile {where}: links.{name} must be a mapping, got {link!r}")
                for key, least in (("bandwidth_Bps", 1e-300), ("latency_s", 0.0)):
                    _optional(link.get(key), f"links.{name}.{key}", where, least)
            for key in ("forward_s", "backward_s"):
                _optional(overhead.get(key), f"overhead.{key}", where, 0.0)
            cuda_memory = data.get("cuda_memory") or {}
            for key in MEASURED_CUDA_KEYS:
                _optional(cuda_memory.get(key), f"cuda_memory.{key}", where, 0.0)
            stream = data.get("stream") or {}
            for mbs, entry in stream.items():
                if not isinstance(entry, dict):
                    raise UsageError(f"--profile {where}: stream.{mbs} must be a mapping, got {entry!r}")
                for key, least in (("depth", 1.0), ("stream_s", 1e-300), ("units_s", 1e-300)):
                    if _optional(entry.get(key), f"stream.{mbs}.{key}", where, least) is None:
                        raise KeyError(f"stream.{mbs}.{key}")
            host, step = data.get("host_memory") or {}, data.get("optimizer") or {}
            for section, keys, got in (("host_memory", HOST_MEMORY_KEYS, host), ("optimizer", OPTIMIZER_KEYS, step)):
                for key in keys:
                    least = 1e-300 if key == "bytes_per_s" else 0.0
                    if _optional(got.get(key), f"{section}.{key}", where, least) is None and got:
                        raise KeyError(f"{section}.{key}")
            load = _load(data.get("load") or {}, where)
            cp_core = _cp_core(data.get("cp_core") or {}, where)
            return cls(device=data["device"], dtype=data["dtype"], model=model, units=units,
                       links=links, overhead=overhead, mode=mode,
                       overlap_factor=overlap, memory_workspace_bytes=workspace, memory_fragmentation=fragmentation,
                       calibration=dict(calibration), cuda_memory=dict(cuda_memory), stream=dict(stream),
                       host_memory=dict(host), optimizer=dict(step), machine_load=load,
                       cp_core=cp_core)
        except KeyError as exc:
            raise UsageError(f"--profile {where}: missing field {exc}") from None
        except (TypeError, AttributeError) as exc:
            raise UsageError(f"--profile {where}: malformed ({exc})") from None


def _cp_core(data, where: str) -> dict:
    """The cp_core section checked: {cp size >= 2: {micro-batch size >= 1: {forward_s, backward_s >= 0}}}."""
    if not isinstance(data, dict):
        raise UsageError(f"--profile {where}: cp_core must be a mapping, got {data!r}")
    for cp, sizes in data.items():
        if not str(cp).isdigit() or int(cp) < 2 or not isinstance(sizes, dict) or not sizes:
            raise UsageError(f"--profile {where}: cp_core.{cp} must map micro-batch sizes to times, at a cp size >= 2")
        for b, entry in sizes.items():
            if not str(b).isdigit() or int(b) < 1 or not isinstance(entry, dict):
                raise UsageError(f"--profile {where}: cp_core.{cp}.{b} must be a micro-batch size's times")
            for key in ("forward_s", "backward_s"):
                if _optional(entry.get(key), f"cp_core.{cp}.{b}.{key}", where, 0.0) is None:
                    raise KeyError(f"cp_core.{cp}.{b}.{key}")
    return {str(cp): {str(b): dict(e) for b, e in sizes.items()} for cp, sizes in data.items()}


def _optional(value, name: str, where: str, least: float) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < least:
        shown = "> 0" if 0 < least < 1e-200 else f">= {least:g}"
        raise UsageError(f"--profile {where}: {name} must be a number {shown}, got {value!r}")
    return float(value)


def _load(load: dict, where: str) -> dict:
    """The "load" section checked: cores an integer >= 1, start and end three load averages >= 0, seconds and own
    numbers >= 0."""
    if not load:
        return {}
    for key in LOAD_KEYS:
        if key not in load:
            raise KeyError(f"load.{key}")
    cores = load["cores"]
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise UsageError(f"--profile {where}: load.cores must be an integer >= 1, got {cores!r}")
    for key in ("start", "end"):
        got = load[key]
        if not isinstance(got, list) or len(got) != 3:
            raise UsageError(f"--profile {where}: load.{key} must be the 1, 5 and 15-minute load averages, got {got!r}")
        for i, value in enumerate(got):
            _number(value, f"load.{key}[{i}]", where)
    for key in ("seconds", "own"):
        _number(load[key], f"load.{key}", where)
    return dict(load)


def _number(value, name: str, where: str) -> float:
    """A number >= 0 that must be there."""
    if value is None:
        raise UsageError(f"--profile {where}: {name} must be a number >= 0, got None")
    return _optional(value, name, where, 0.0)


def _unit_timing(entry, i: int, where: str) -> UnitTiming:
    """One unit entry, every number checked: a negative or NaN time would make the planner's choice nonsense."""
    if not isinstance(entry, dict):
        raise UsageError(f"--profile {where}: units[{i}] must be a mapping, got {entry!r}")
    timing = UnitTiming(**entry)
    if timing.kind not in ALL_UNIT_KINDS:
        raise UsageError(f"--profile {where}: units[{i}].kind must be one of {', '.join(ALL_UNIT_KINDS)}, got "
                         f"{timing.kind!r}")
    for key in ("tp", "micro_batch_size"):
        value = getattr(timing, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"--profile {where}: units[{i}].{key} must be an integer >= 1, got {value!r}")
    for key in ("forward_s", "backward_s"):
        _optional(getattr(timing, key), f"units[{i}].{key}", where, 0.0)
        if getattr(timing, key) is None:
            raise UsageError(f"--profile {where}: units[{i}].{key} is missing")
    _optional(timing.saved_bytes, f"units[{i}].saved_bytes", where, 0.0)
    if timing.unit is not None and (isinstance(timing.unit, bool) or not isinstance(timing.unit, int) or timing.unit < 0):
        raise UsageError(f"--profile {where}: units[{i}].unit must be a unit index >= 0, got {timing.unit!r}")
    recomputed = {"attention": ("full", "selective"), "mlp": ("full",), "moe": ("full",)}.get(timing.kind, ())
    if timing.recompute is not None and timing.recompute not in recomputed:
        can = f"one of {', '.join(recomputed)} or null" if recomputed else "null (never recomputed)"
        raise UsageError(f"--profile {where}: units[{i}].recompute must be {can} for {timing.kind} units, got "
                         f"{timing.recompute!r}")
    return timing


class Profiles:
    """The profiles of a run, by device type: a device type with none is an error (a profile measured on one
    device says little about another), unless no profile is given at all (analytic times)."""

    def __init__(self, profiles: list[Profile] | None = None) -> None:
        self.by_type: dict[str, list[Profile]] = {}
        for p in profiles or []:
            self.by_type.setdefault(p.device_type_name, []).append(p)

    def __bool__(self) -> bool:
        return bool(self.by_type)

    def for_device(self, device_type: str) -> list[Profile]:
        if not self.by_type:
            return []
        if device_type not in self.by_type:
            raise UsageError(f"--profile: no profile for device type {device_type} (profiles are for "
                             f"{', '.join(sorted(self.by_type))}); profile that device (autoconfig.py profile "
                             f"--device-type {device_type}) or give no --profile for analytic times")
        return self.by_type[device_type]

    def _fitted(self, name: str) -> float | None:
        """The largest of the profiles' `name` (the most cautious where device types differ), None if none has it."""
        values = [getattr(p, name) for ps in self.by_type.values() for p in ps if getattr(p, name) is not None]
        return max(values) if values else None

    @property
    def overlap_factor(self) -> float | None:
        return self._fitted("overlap_factor")

    @property
    def memory_workspace_bytes(self) -> float | None:
        return self._fitted("memory_workspace_bytes")

    @property
    def memory_fragmentation(self) -> float | None:
        return self._fitted("memory_fragmentation")

    def measured_cuda_memory(self) -> MeasuredCudaMemory:
        """The profiles' measured CUDA allowance terms, the largest of each where several measured it."""
        got = {}
        for key in MEASURED_CUDA_KEYS:
            values = [p.cuda_memory[key] for ps in self.by_type.values() for p in ps
                      if p.cuda_memory.get(key) is not None]
            got[key] = float(max(values)) if values else None
        return MeasuredCudaMemory(**got)

    def host_memory(self) -> tuple[float, float] | None:
        """(runtime bytes, fraction) a CPU training process holds beyond its tensors, the largest of each where
        several profiles measured them; None where none did."""
        measured = [p.host_memory for ps in self.by_type.values() for p in ps if p.host_memory]
        if not measured:
            return None
        return max(m["runtime_bytes"] for m in measured), max(m["fraction"] for m in measured)

    def largest_micro_batch(self) -> int | None:
        """The largest micro-batch size at which every profile timed its layers (attention, MLP and MoE units), None
        without profiles: unit_time extrapolates beyond it."""
        sizes = [max((u.micro_batch_size for u in p.units if u.kind in ("attention", "mlp", "moe")), default=0)
                 for ps in self.by_type.values() for p in ps]
        return min(sizes) if sizes else None

    def identity(self) -> list[dict]:
        """What a plan records of the profiles it was made with."""
        return [{"device_type": t, "mode": p.mode, "device": p.device.get("name"), "dtype": p.dtype,
                 "source": p.source, **({"load": p.machine_load} if p.machine_load else {})}
                for t, ps in sorted(self.by_type.items()) for p in ps]


def _interpolate(points: list[tuple[int, float, float]], x: float) -> tuple[float, float]:
    if len(points) == 1:
        b, f, g = points[0]
        return f * x / b, g * x / b
    below = [p for p in points if p[0] <= x]
    above = [p for p in points if p[0] >= x]
    if below and above:
        lo, hi = below[-1], above[0]
    elif below:
        lo, hi = points[-2], points[-1]
    else:
        lo, hi = points[0], points[1]
    if hi[0] == lo[0]:
        return lo[1], lo[2]
    w = (x - lo[0]) / (hi[0] - lo[0])
    return (max(0.0, lo[1] + w * (hi[1] - lo[1])), max(0.0, lo[2] + w * (hi[2] - lo[2])))
