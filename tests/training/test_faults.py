"""A flaky cluster: hung ranks, ranks that fail alone, outputs that cannot be written. Real processes, one line each."""

import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_bmw.device import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1",
        "--make-vocab-size-divisible-by", "4"]


def _launch(world: int, args: list[str], tmp_path) -> list[subprocess.Popen]:
    """`world` pretrain_gpt.py processes wired as torchrun would, each logging to its own files."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        out = open(tmp_path / f"out{rank}.txt", "w")
        err = open(tmp_path / f"err{rank}.txt", "w")
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], env=env,
                                      stdout=out, stderr=err, cwd=str(tmp_path)))
    return procs


def _wait_for(path, needle: str, timeout: float) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if path.exists() and needle in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{needle!r} never appeared in {path}")


def _kill_all(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _errors(tmp_path, rank: int) -> list[str]:
    return [line for line in (tmp_path / f"err{rank}.txt").read_text().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--pipeline-model-parallel-size", "2"], []], ids=["pp2", "dp2"])
def test_a_hung_rank_fails_the_job_within_the_timeout(tmp_path, layout):
    timeout_min = 0.15
    procs = _launch(2, TINY + layout + ["--train-iters", "1000000", "--distributed-timeout-minutes",
                                        str(timeout_min)], tmp_path)
    try:
        last = 1  # the loss is logged by the last rank
        _wait_for(tmp_path / f"out{last}.txt", " iteration        3/", 120)
        procs[1].send_signal(signal.SIGSTOP)
        rc = procs[0].wait(timeout=timeout_min * 60 + 90)  # a hang would raise here instead
    finally:
        _kill_all(procs)
    assert rc == 1
    lines = _errors(tmp_path, 0)
    assert len(lines) == 1 and lines[0].startswith("error: rank 0: lost contact with another rank"), lines
    assert "--distributed-timeout-minutes" in lines[0]


def _one_process(args, tmp_path, tool="pretrain_gpt.py"):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run([sys.executable, os.path.join(ROOT, *tool.split("/")), *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("flag,kind", [("--save", "file"), ("--tensorboard-dir", "file"), ("--save", "under-file"),
                                       ("--pipeline-trace", "dir"), ("--pipeline-trace", "no-folder")])
def test_unusable_output_paths_are_refused_at_start_up(tmp_path, flag, kind):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir").mkdir()
    path = {"file": tmp_path / "a_file", "under-file": tmp_path / "a_file" / "ckpt", "dir": tmp_path / "a_dir",
            "no-folder": tmp_path / "missing" / "trace.json"}[kind]
    out = _one_process(TINY + ["--train-iters", "2", flag, str(path)], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {flag} {path}"), lines
    assert "iteration" not in out.stdout  # refused before training


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_save_directory_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    out = _one_process(TINY + ["--train-iters", "2", "--save", str(ro)], tmp_path)
    assert out.returncode == 2 and "cannot write in" in out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command,flag", [("search", "--output"), ("search", "--timeline"), ("simulate", "--timeline"),
                                          ("profile", "--output")])
def test_autoconfig_output_that_is_a_directory_is_refused(tmp_path, command, flag):
    args = [command, flag, str(tmp_path)] + (["--global-batch-size", "8"] if command == "search" else [])
    out = _one_process(args, tmp_path, tool="tools/autoconfig.py")
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == f"error: {flag} {tmp_path}: is a directory, expected a file name"


@pytest.mark.slow
def test_autoconfig_world_size_zero_is_refused(tmp_path):
    out = _one_process(["search", "--world-size", "0", "--global-batch-size", "8"], tmp_path, tool="tools/autoconfig.py")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == "error: argument --world-size: --world-size must be >= 1, got 0"


@pytest.mark.slow
def test_a_truncated_stage_checkpoint_stops_every_rank_with_that_ranks_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = TINY + ["--pipeline-model-parallel-size", "2", "--distributed-timeout-minutes", "1"]
    procs = _launch(2, args + ["--train-iters", "2", "--save", str(ckpt)], tmp_path)
    assert [p.wait(timeout=180) for p in procs] == [0, 0]
    stage1 = ckpt / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt"
    stage1.write_bytes(stage1.read_bytes()[:100])
    procs = _launch(2, args + ["--train-iters", "4", "--load", str(ckpt)], tmp_path)
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        _kill_all(procs)
    assert codes == [2, 2]
    assert _errors(tmp_path, 0) == []
    lines = _errors(tmp_path, 1)
    assert len(lines) == 1 and lines[0].startswith(f"error: rank 1: --load {ckpt}") and "mp_rank_00_001" in lines[0]
    assert "successfully loaded" not in (tmp_path / "out0.txt").read_text()


def _disk_full_case(rank, world_size, ckpt, kind):
    import errno

    import torch

    from megatron_bmw.errors import Reported
    from megatron_bmw.training import checkpointing
    from megatron_bmw.training.loop import build_trainer

    argv = TINY + ["--pipeline-model-parallel-size", "2", "--train-iters", "4", "--save", ckpt, "--save-interval", "2"]
    trainer = build_trainer(argv)
    real_save = torch.save

    def full(obj, path, *a, **k):
        if trainer.iteration == 4 and rank == 1:
            if kind == "runtime":  # what torch.save raises when the disk fills under its zip writer
                raise RuntimeError("[enforce fail at inline_container.cc:783] . PytorchStreamWriter failed writing "
                                   "file data/3: file write failed")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    checkpointing.torch.save = full
    try:
        trainer.train()
    except Reported as exc:
        return exc.exit_code
    finally:
        checkpointing.torch.save = real_save
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["oserror", "runtime"])
def test_a_full_disk_at_save_stops_every_rank_and_keeps_the_previous_checkpoint(tmp_path, capfd, kind):
    from tests.dist_harness import run_distributed

    ckpt = str(tmp_path / "ckpt")
    assert run_distributed(2, _disk_full_case, ckpt, kind) == [1, 1]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


@pytest.mark.slow
def test_divergence_and_argparse_errors_are_one_line_once(tmp_path):
    procs = _launch(2, TINY + ["--train-iters", "3", "--no-such-flag"], tmp_path)
    assert [p.wait(timeout=120) for p in procs] == [2, 2]
    assert _errors(tmp_path, 0) == ["error: unrecognized arguments: --no-such-flag"] and _errors(tmp_path, 1) == []
    procs = _launch(2, TINY + ["--train-iters", "3", "--lr", "1e30", "--clip-grad", "0",
                               "--distributed-timeout-minutes", "1"], tmp_path)
    assert [p.wait(timeout=120) for p in procs] == [1, 1]
    lines = _errors(tmp_path, 0)
    assert len(lines) == 1 and lines[0].startswith("error: ") and _errors(tmp_path, 1) == []


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process tree from /proc")
def test_workers_stop_and_save_when_the_launcher_is_killed(tmp_path):
    """kill -9 of torchrun left its workers training and saving for minutes (#28): they notice and stop."""
    ckpt = tmp_path / "ckpt"
    log = open(tmp_path / "torchrun.txt", "w")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                                 os.path.join(ROOT, "pretrain_gpt.py"), *TINY, "--train-iters", "1000000",
                                 "--save", str(ckpt), "--save-interval", "1000000", "--eval-iters", "0"],
                                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp_path))
    workers = []
    try:
        _wait_for(tmp_path / "torchrun.txt", " iteration        3/", 120)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.kill()
        launcher.wait()
        end = time.time() + 60
        while any(_alive(p) for p in workers) and time.time() < end:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "workers outlived their launcher"
    finally:
        for p in workers:
            if _alive(p):
                os.kill(p, signal.SIGKILL)
        log.close()
    text = (tmp_path / "torchrun.txt").read_text()
    assert "the launcher (pid" in text and "is gone" in text, text[-2000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").exists()  # saved on the way out, like SIGTERM
