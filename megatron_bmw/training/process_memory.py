"""What this process really holds in host memory (Linux /proc), for the plan check of a CPU run.

`ResidentPeak()` marks a start: it resets the kernel's peak-resident counter (VmHWM, by writing 5 to
/proc/self/clear_refs) and reads the resident size then; `growth()` is the peak since, minus that start. Without
/proc (or where the reset is refused) the peak falls back to getrusage's, which covers the whole process life.
"""

from __future__ import annotations

import resource


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


class ResidentPeak:
    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.base = _status_bytes("VmRSS")

    def growth(self) -> float | None:
        """Bytes the resident peak rose above the start (None where the start could not be read)."""
        if self.base is None:
            return None
        peak = _status_bytes("VmHWM") if self.reset else None
        if peak is None:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
        return float(max(0, peak - self.base))
