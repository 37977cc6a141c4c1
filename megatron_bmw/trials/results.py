"""The results file: JSON lines, one object per trial attempt, appended and flushed as the sweep goes.

A trial's latest line decides its state. `running` is written when a trial starts, so a sweep killed in the
middle leaves that trial unfinished and the next sweep runs it again; the final statuses are
  ok          ran; median iteration time and throughput measured
  oom         out of memory (CUDA's message in the output, or a plan check above the device's capacity)
  crash       non-zero exit, or no iteration line after warm-up (the last `error:` line kept)
  hang        still running at --trial-timeout; killed with its whole process tree
  infeasible  refused before launch (the reason is what pretrain_gpt.py would have said)
A line cut short by a kill is skipped when reading. One sweep at a time may write a file (a lock beside it).
"""

from __future__ import annotations

import json
import math
import os
import sys

from ..errors import UsageError

FINAL = ("ok", "oom", "crash", "hang", "infeasible")


class Results:
    def __init__(self, path: str, flag: str = "--results") -> None:
        """`flag`: what the messages name the file by (the flag that gave it, or its folder's)."""
        self.path, self.flag = path, flag
        self.latest: dict[str, dict] = {}
        self.attempts: dict[str, int] = {}
        self._lock = None
        self._cut_at: int | None = None  # byte offset of a last line cut short by a kill
        self._newline_first = False  # the last record lacks its newline
        if os.path.exists(path):
            self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                lines = f.read().splitlines(keepends=True)
        except OSError as exc:
            raise UsageError(f"{self.flag} {self.path}: cannot read it ({exc.strerror})") from None
        unterminated = bool(lines) and not lines[-1].endswith(b"\n")
        for n, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                if n == len(lines) and unterminated:  # cut by a kill: the first append drops it
                    self._cut_at = sum(len(x) for x in lines[:-1])
                    print(f"warning: {self.flag} {self.path}: line {n} was cut short (a killed sweep); skipped",
                          file=sys.stderr, flush=True)
                    continue
                raise UsageError(f"{self.flag} {self.path}: line {n} is not a JSON record (not a results file, or "
                                 "edited by hand?)") from None
            if isinstance(record, dict) and "id" in record:
                self._check(record, n)
                self.latest[record["id"]] = record
                if record.get("status") == "running":
                    self.attempts[record["id"]] = self.attempts.get(record["id"], 0) + 1
        self._newline_first = unterminated and self._cut_at is None

    def _check(self, record: dict, n: int) -> None:
        """A record the readers can use: a string id, a known status, an ok trial's positive median time."""
        where = f"{self.flag} {self.path}: line {n}"
        if not isinstance(record["id"], str):
            raise UsageError(f"{where}: id must be a string, got {record['id']!r} (edited by hand?)")
        status = record.get("status")
        if status not in (*FINAL, "running"):
            raise UsageError(f"{where}: status must be one of {', '.join(FINAL)} or running, got {status!r}")
        median = record.get("median_iteration_s")
        number = isinstance(median, (int, float)) and not isinstance(median, bool)
        if status == "ok" and not (number and 0 < median < math.inf):
            raise UsageError(f"{where}: an ok trial needs median_iteration_s > 0, got {median!r} (edited by hand?)")

    def lock(self) -> None:
        """Hold an exclusive lock on `<results>.lock` until the process ends."""
        import fcntl

        folder = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(folder):
            raise UsageError(f"{self.flag} {self.path}: folder {folder} does not exist")
        try:
            self._lock = open(self.path + ".lock", "w")
        except OSError as exc:
            raise UsageError(f"{self.flag} {self.path}: cannot write beside it ({exc.strerror})") from None
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(f"{self.flag} {self.path}: another sweep is writing it") from None

    def unlock(self) -> None:
        """Release the lock (a process that goes on after its sweep)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def done(self, trial_id: str, retry: tuple[str, ...] = ()) -> bool:
        status = self.latest.get(trial_id, {}).get("status")
        return status in FINAL and status not in retry

    def append(self, record: dict) -> None:
        self.latest[record["id"]] = record
        if record.get("status") == "running":
            self.attempts[record["id"]] = self.attempts.get(record["id"], 0) + 1
        try:
            if self._cut_at is not None:
                os.truncate(self.path, self._cut_at)
                self._cut_at = None
            with open(self.path, "a") as f:
                f.write(("\n" if self._newline_first else "") + json.dumps(record) + "\n")
                self._newline_first = False
                f.flush()
                os.fsync(f.fileno())
        except OSError as exc:
            raise UsageError(f"{self.flag} {self.path}: cannot write it ({exc.strerror})") from None

    def final_records(self) -> list[dict]:
        return [r for r in self.latest.values() if r.get("status") in FINAL]


def load_results(path: str) -> list[dict]:
    """The latest final record of every trial in a results file (for reports and calibration)."""
    if not os.path.exists(path):
        raise UsageError(f"--results {path}: no such file")
    return Results(path).final_records()
