"""What a trial's log says: Megatron's iteration lines, memory lines, out-of-memory and the last error.

Lines are matched anywhere in a line, so prefixes (a `[YYYY-MM-DD HH:MM:SS]` timestamp, torchrun's `[rank3]:`)
and fields added to the iteration line (`throughput per GPU (TFLOP/s/GPU): ...`) do not disturb the parse.
Memory comes from any of: our trial entry (`trial memory | rank R | stage S | peak allocated B | ...`), a --plan
run's `plan check | stage S | memory predicted X MiB, measured Y MiB ... | capacity Z GiB`, the
`activation memory | stage S | ... | peak bytes B` lines of --log-activation-memory, and Megatron's
`memory (MB) | allocated: A | max allocated: M | reserved: R | max reserved: X`.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field

ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
FIELD = re.compile(r"^\s*([^:|]+?)\s*:\s*([-+0-9.eEinfa]+)\s*$")
OOM = re.compile(r"out of memory|OutOfMemoryError|CUDA error: out of memory", re.IGNORECASE)
ERROR_LINE = re.compile(r"(?:^|[\s:\]])error: (.+)$")
EXCEPTION_LINE = re.compile(r"\b([A-Za-z_.]*(?:Error|Exception)): (.+)$")
TRIAL_MEMORY = re.compile(r"trial memory \| rank (\d+) \| stage (\d+) \|(.*)$")
PLAN_TIME = re.compile(r"plan check \| iteration time predicted ([0-9.]+) s, measured ([0-9.naN]+) s")
PLAN_MEMORY = re.compile(r"plan check \| stage (\d+) \| memory predicted ([0-9.]+) (GiB|MiB), measured ([0-9.]+) "
                         r"(GiB|MiB).*\| capacity ([0-9.]+) (GiB|MiB)")
ACTIVATION_MEMORY = re.compile(r"activation memory \| stage (\d+) \|.*\| peak bytes (\d+)")
MEGATRON_MEMORY = re.compile(r"memory \(MB\) \|.*max allocated: ([0-9.]+)")
UNITS = {"GiB": 2**30, "MiB": 2**20}
LOST_CONTACT = "lost contact with another rank"


@dataclass
class LogSummary:
    iterations: list[dict] = field(default_factory=list)  # one per iteration line: iteration, elapsed_ms, ...
    stage_memory: dict[int, dict] = field(default_factory=dict)  # stage -> {peak_allocated, ...} (max over ranks)
    peak_memory_bytes: float | None = None
    over_capacity: list[int] = field(default_factory=list)  # stages a plan check saw above their device
    plan_check: dict = field(default_factory=dict)
    oom: bool = False
    error: str | None = None  # the last `error:` line (a rank's own before "lost contact"), else exception
    tail: list[str] = field(default_factory=list)

    def iteration_times(self, warmup: int) -> list[float]:
        """Seconds per iteration of the iterations after the first `warmup` (all of them if none is left)."""
        timed = [(it["iteration"], it["elapsed_ms"] / 1e3) for it in self.iterations if "elapsed_ms" in it]
        kept = [t for i, t in timed if i > warmup]
        return kept or [t for _, t in timed]

    def median_iteration_s(self, warmup: int) -> float | None:
        times = self.iteration_times(warmup)
        return statistics.median(times) if times else None


def _number(text: str):
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() and "." not in text and "e" not in text.lower() else value


def parse_iteration(line: str) -> dict | None:
    """One iteration line -> {iteration, train_iters, elapsed_ms, global_batch_size, lm_loss, ...} (every
    numeric `name: value` field, named in snake case), or None."""
    m = ITERATION.search(line)
    if not m:
        return None
    out = {"iteration": int(m.group(1)), "train_iters": int(m.group(2))}
    for part in m.group(3).split("|"):
        f = FIELD.match(part)
        if not f:
            continue
        value = _number(f.group(2))
        if value is None:
            continue
        name = f.group(1).lower()
        if name.startswith("elapsed time per iteration"):
            name = "elapsed_ms"
        out[re.sub(r"[^a-z0-9]+", "_", name).strip("_")] = value
    return out


def _memory_fields(text: str) -> dict:
    """`| peak allocated 123 | device used 456` -> {peak_allocated: 123, device_used: 456}."""
    out = {}
    for part in text.split("|"):
        words = part.split()
        # the name, then the first number; what follows it is another rank's output glued on (ranks share the log)
        at = next((i for i, w in enumerate(words) if _number(w) is not None), None)
        if at:
            out["_".join(words[:at])] = float(words[at])
    return out


def parse_log(text: str, tail_lines: int = 30) -> LogSummary:
    out = LogSummary()
    lines = text.splitlines()
    out.tail = lines[-tail_lines:]

    def stage_max(stage: int, key: str, value: float) -> None:
        entry = out.stage_memory.setdefault(stage, {})
        entry[key] = max(entry.get(key, 0.0), value)

    errors: list[str] = []
    exceptions: list[str] = []
    for line in lines:
        it = parse_iteration(line)
        m = TRIAL_MEMORY.search(line)
        if m:  # before the iteration test: another rank's iteration line may be glued onto it
            for key, value in _memory_fields(m.group(3)).items():
                stage_max(int(m.group(2)), key, value)
        if it is not None:
            out.iterations.append(it)
            continue
        if m:
            continue
        if OOM.search(line):
            out.oom = True
        m = PLAN_TIME.search(line)
        if m:
            out.plan_check.update(predicted_s=float(m.group(1)), measured_s=float(m.group(2)))
            continue
        m = PLAN_MEMORY.search(line)
        if m:
            stage = int(m.group(1))
            predicted = float(m.group(2)) * UNITS[m.group(3)]
            measured = float(m.group(4)) * UNITS[m.group(5)]
            capacity = float(m.group(6)) * UNITS[m.group(7)]
            stage_max(stage, "plan_check_measured", measured)
            out.plan_check.setdefault("stages", {})[stage] = {"predicted_bytes": predicted, "measured_bytes": measured,
                                                              "capacity_bytes": capacity}
            if measured > capacity:
                out.over_capacity.append(stage)
            continue
        m = ACTIVATION_MEMORY.search(line)
        if m:
            stage_max(int(m.group(1)), "activation_peak", float(m.group(2)))
            continue
        m = MEGATRON_MEMORY.search(line)
        if m:
            stage_max(-1, "max_allocated", float(m.group(1)) * 2**20)
            continue
        m = ERROR_LINE.search(line)
        if m:
            errors.append("error: " + m.group(1).strip())
            continue
        m = EXCEPTION_LINE.search(line)
        if m and "ChildFailedError" not in m.group(1):
            exceptions.append(f"{m.group(1)}: {m.group(2).strip()}")
    # The last `error:` line, preferring a rank's own error to the others' "lost contact" that follows it.
    own = [e for e in errors if LOST_CONTACT not in e]
    out.error = (own or errors or exceptions or [None])[-1]
    peaks = [next((e[k] for k in ("peak_allocated", "plan_check_measured", "max_allocated") if k in e), None)
             for e in out.stage_memory.values()]
    peaks = [p for p in peaks if p is not None]
    out.peak_memory_bytes = max(peaks) if peaks else None  # the largest stage's, exact figures first
    return out
