"""Time lost per failure under torchrun's elastic agents with --plan auto: two agents (two "nodes") of --nproc gloo
ranks each train a small GPT with torch_dist checkpoints; one agent is killed with its ranks; the survivor's ranks
fail fast, it restarts them on the world that is left, they re-plan and resume from the last checkpoint. Each
phase is timed from the output lines as they arrive; medians over --repeats failures.

    python benchmarks/elastic_restart.py [--repeats 3 --nproc 2 --num-layers 4 --hidden-size 64 --dir /tmp/x]

Phases: detect (the kill to the survivors' first 'lost contact' line), rendezvous (to the agent's new round:
stopping its ranks, dropping the dead node after its missed heartbeats, the last call), start (to the search:
new processes, imports, the process group), re-plan (the search on rank 0 and its broadcast), build (the model
and the optimizer), load (the torch_dist checkpoint), first iteration; and the work lost: iterations since the
checkpoint, done again.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.args import count, exit_on_usage_error, output_dirs, parser  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the agents' rendezvous: a dead agent is dropped after 2 missed 1 s heartbeats, a round closes 2 s after the first
# node that is enough (--nnodes 1:2) has joined
RDZV_CONF = "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=90"
CPU_CLUSTER = ("name: cpu-ranks\ninter_node: {bandwidth_GBps: 1, latency_us: 50}\n"
               "device_types: {cpu: {memory_gb: 4, peak_tflops: {fp32: 0.02}}}\n"
               "groups: [{nodes: 1, gpus_per_node: 2, device: cpu, intra_node: {bandwidth_GBps: 1, latency_us: 50}}]\n")
ITERATION = re.compile(r"\] iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([\d.]+)")
PHASES = ("detect", "rendezvous", "start", "re-plan", "build", "load", "first iteration")


def agent_command(port: int, is_host: bool, nproc: int, argv: list[str], max_restarts: int = 2) -> list[str]:
    """torchrun as one elastic agent of `nproc` ranks (--nnodes 1:2, c10d rendezvous on this machine); the host
    agent holds the rendezvous store, so it is the one that may not be lost."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", str(nproc),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic",
            "--rdzv-conf", f"is_host={int(is_host)},{RDZV_CONF}", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.2", os.path.join(ROOT, "pretrain_gpt.py"), *argv]


def start_agent(cmd: list[str], stdout, log_level: str = "WARNING") -> subprocess.Popen:
    """The agent in a session of its own, its ranks' output unbuffered into `stdout`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LOGLEVEL=log_level)
    return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True,
                            text=True)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (torchrun starts its ranks in sessions of their own, so a process group
    does not hold them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL an agent and every process below it, as a node that dies takes them all."""
    for pid in descendants(proc.pid) + [proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stamped:
    """The lines of a pipe, each with the time it arrived (a reader thread)."""

    def __init__(self, pipe) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._thread.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def first(self, pattern: str, after: float) -> tuple[float, str]:
        for t, line in self.lines:
            if t >= after and re.search(pattern, line):
                return t, line
        raise RuntimeError(f"no line matching {pattern!r} after the kill; the survivor's output ends:\n"
                           + "\n".join(line for _, line in self.lines[-30:]))

    def iterations(self, before: float | None = None) -> list[tuple[int, float]]:
        """(iteration, ms) of the iteration lines (arrived before `before`)."""
        out = []
        for t, line in self.lines:
            m = ITERATION.search(line)
            if m and (before is None or t < before):
                out.append((int(m.group(1)), float(m.group(2))))
        return out


def run_argv(args, run_dir: str) -> list[str]:
    cluster = os.path.join(run_dir, "cpu.yaml")
    with open(cluster, "w") as f:
        f.write(CPU_CLUSTER)
    ckpt = os.path.join(run_dir, "ckpt")
    return ["--mock-data", "--vocab-size", "128", "--num-layers", str(args.num_layers), "--hidden-size",
            str(args.hidden_size), "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "16",
            "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--attention-backend", "unfused",
            "--train-iters", str(args.iters), "--plan", "auto", "--plan-cluster", cluster, "--save", ckpt, "--load",
            ckpt, "--ckpt-format", "torch_dist", "--save-interval", str(args.save_interval),
            "--distributed-timeout-minutes", "0.5"]


def one_failure(args, run_dir: str) -> dict[str, float]:
    """One run, one lost node: seconds per phase, and the work done again."""
    os.makedirs(run_dir, exist_ok=True)
    argv, port = run_argv(args, run_dir), free_port()
    lost = start_agent(agent_command(port, False, args.nproc, argv), subprocess.PIPE)
    host = start_agent(agent_command(port, True, args.nproc, argv), subprocess.PIPE, log_level="INFO")
    outs = [Stamped(host.stdout), Stamped(lost.stdout)]
    deadline = time.monotonic() + args.timeout
    try:
        while max((i for o in outs for i, _ in o.iterations()), default=0) < args.kill_at:
            if time.monotonic() > deadline or host.poll() is not None or lost.poll() is not None:
                raise RuntimeError(f"the run did not reach iteration {args.kill_at} on both agents; the host's "
                                   "output ends:\n" + "\n".join(line for _, line in outs[0].lines[-30:]))
            time.sleep(0.05)
        killed = time.monotonic()
        kill_node(lost)
        host.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in (host, lost):
            kill_node(proc)
    outs[0].join(5.0)
    return _phases(outs, killed)


def _phases(outs: list[Stamped], killed: float) -> dict[str, float]:
    host = outs[0]
    detect, _ = host.first(r"lost contact with another rank", killed)
    rendezvous, _ = host.first(r"Rendezvous complete for workers", detect)
    planned, line = host.first(r"> --plan auto: searched \d+ ranks", rendezvous)
    search_s = float(re.search(r" in ([\d.]+) s", line).group(1))
    built, _ = host.first(r"> pipeline partition", planned)
    loaded, line = host.first(r"successfully loaded checkpoint", built)
    resumed_from = int(re.search(r"at iteration (\d+)", line).group(1))
    first, _ = host.first(r"\] iteration\s+\d+/", loaded)
    before = [x for o in outs for x in o.iterations(before=killed)]
    reached = max(i for i, _ in before)
    per_iteration = sorted(ms for _, ms in before)[len(before) // 2] / 1e3
    return {"detect": detect - killed, "rendezvous": rendezvous - detect, "start": planned - search_s - rendezvous,
            "re-plan": search_s, "build": built - planned, "load": loaded - built, "first iteration": first - loaded,
            "total": first - killed, "redone iterations": reached - resumed_from,
            "redone s": (reached - resumed_from) * per_iteration}


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


@exit_on_usage_error
def main() -> None:
    p = parser(__doc__)
    p.add_argument("--repeats", type=count(1), default=3, help="failures timed (a fresh run each)")
    p.add_argument("--nproc", type=count(1), default=2, help="ranks per agent")
    p.add_argument("--num-layers", type=count(1), default=4)
    p.add_argument("--hidden-size", type=count(4), default=64, help="a multiple of the 4 attention heads")
    p.add_argument("--iters", type=count(2), default=60)
    p.add_argument("--save-interval", type=count(1), default=10)
    p.add_argument("--kill-at", type=count(1), default=15, help="the iteration after which the node is lost")
    p.add_argument("--timeout", type=count(10), default=300, help="seconds one run may take")
    p.add_argument("--dir", default="/tmp/megatron_bmw_elastic_bench")
    args = p.parse_args()
    if args.hidden_size % 4:
        p.error(f"--hidden-size {args.hidden_size}: must be a multiple of the 4 attention heads")
    if args.kill_at >= args.iters:
        p.error(f"--kill-at {args.kill_at}: must come before the last iteration (--iters {args.iters})")
    output_dirs(dir=args.dir)
    runs = []
    for i in range(args.repeats):
        run_dir = os.path.join(args.dir, f"run{i}")
        shutil.rmtree(run_dir, ignore_errors=True)
        runs.append(one_failure(args, run_dir))
        print(f"failure {i + 1}/{args.repeats}: {runs[-1]['total']:.1f} s from the kill to the first iteration",
              flush=True)
    shutil.rmtree(args.dir, ignore_errors=True)
    _print(args, runs)


def _print(args, runs: list[dict[str, float]]) -> None:
    print(f"\nGPT {args.num_layers} layers x {args.hidden_size} hidden, {2 * args.nproc} -> {args.nproc} gloo ranks "
          f"(two torchrun agents, --nnodes 1:2, --rdzv-conf {RDZV_CONF}), --plan auto, torch_dist every "
          f"{args.save_interval} iterations; the node lost after iteration {args.kill_at}; seconds, median of "
          f"{len(runs)} (min - max)")
    width = max(map(len, PHASES + ("total (kill -> first iteration)",)))
    for name in PHASES + ("total",):
        xs = [r[name] for r in runs]
        label = "total (kill -> first iteration)" if name == "total" else name
        print(f"  {label:<{width}}  {median(xs):7.2f}  ({min(xs):.2f} - {max(xs):.2f})")
    redone = [r["redone iterations"] for r in runs]
    print(f"  {'work done again':<{width}}  {median([r['redone s'] for r in runs]):7.2f}  ({median(redone):.0f} "
          "iterations since the checkpoint, at the 4-rank speed)")


if __name__ == "__main__":
    sys.exit(main())
