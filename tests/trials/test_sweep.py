"""Sweeps for real: 2-rank trials of a tiny GPT on gloo through torchrun and through srun (a fake srun and sbatch
on PATH that start the tasks here with SLURM's variables), and a stand-in trainer (fake/fake_trainer.py) for
crashes, hangs, out-of-memory and a sweep killed in the middle."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TOOL = os.path.join(ROOT, "tools", "grid_search.py")
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --vocab-size 256 --mock-data "
        "--global-batch-size 4").split()


@pytest.fixture
def fake_bin(tmp_path):
    """A folder with the fake srun and sbatch (executable), to put first on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("srun", "sbatch"):
        shutil.copy(os.path.join(HERE, "fake", name), folder / name)
        os.chmod(folder / name, 0o755)
    return str(folder)


def _env(fake_bin=None, slurm=False, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, **extra)
    if fake_bin:
        env["PATH"] = fake_bin + os.pathsep + env["PATH"]
    if slurm:
        env.update(SLURM_JOB_ID="4242", SLURM_NNODES="1")
    return env


def _sweep(args, tmp_path, env, check=True, timeout=240):
    proc = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _latest(path):
    out = {}
    for r in _records(path):
        out[r["id"]] = r
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _all_die(pids: list[int], timeout: float = 30.0) -> bool:
    """Whether every process is gone (or a zombie) within `timeout`: a poll, not a fixed sleep."""
    end = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.slow
def test_local_torchrun_sweep(tmp_path):
    """Real trials: one runs, one crashes at start-up (a --save folder that cannot be made), two are infeasible; the
    report has the prediction beside the measurement; a second run of the same sweep runs nothing."""
    results = tmp_path / "sweep.jsonl"
    args = ["--nproc-per-node", "2", *TINY, "--pipeline-model-parallel-size", "2,3", "--save",
            "none,/proc/no/such/folder", "--trial-iters", "4", "--warmup-iters", "1", "--results", str(results),
            "--predict"]
    out = _sweep(args, tmp_path, _env()).stdout
    latest = _latest(results)
    by_status = {}
    for r in latest.values():
        by_status.setdefault(r["status"], []).append(r)
    assert sorted((s, len(v)) for s, v in by_status.items()) == [("crash", 1), ("infeasible", 2), ("ok", 1)], out
    ok = by_status["ok"][0]
    assert ok["layout"]["pp"] == 2 and ok["iterations"] == 4 and len(ok["iteration_times_s"]) == 4
    assert ok["median_iteration_s"] > 0 and ok["tokens_per_s"] == pytest.approx(4 * 32 / ok["median_iteration_s"])
    assert ok["peak_memory_bytes"] > 0 and set(ok["stage_memory"]) == {"0", "1"}
    assert os.path.exists(ok["log"]) and ok["exit_code"] == 0
    crash = by_status["crash"][0]
    assert crash["exit_code"] != 0 and crash["reason"].startswith("error: --save /proc/no/such/folder")
    assert all("not divisible" in r["reason"] for r in by_status["infeasible"])
    assert ok["id"] in out and "prediction over 1 trials" in out
    assert (tmp_path / "sweep.png").exists()
    # resumable: everything is final, nothing runs again
    again = _sweep(args, tmp_path, _env()).stdout
    assert "4 trials: 2 infeasible, 4 already in" in again and "0 to go" in again
    assert len(_records(results)) == 6  # 2 infeasible + (running, final) x 2: nothing appended the second time
    # --report-only, without --predict, keeps the prediction the --predict run computed
    report = _sweep(["--report-only", "--results", str(results)], tmp_path, _env()).stdout
    assert "prediction over 1 trials" in report


@pytest.mark.slow
def test_slurm_path_with_fake_sbatch_and_srun(tmp_path, fake_bin):
    """--sbatch writes a script; the (fake) sbatch runs it; its sweep launches the trial with (fake) srun,
    and pretrain_gpt.py takes its ranks from SLURM's variables."""
    script = tmp_path / "sweep.sbatch"
    results = tmp_path / "slurm.jsonl"
    args = ["--sbatch", str(script), "--sbatch-option=--partition=gpu", "--nproc-per-node", "2", *TINY,
            "--pipeline-model-parallel-size", "2", "--trial-iters", "3", "--warmup-iters", "1", "--results",
            str(results)]
    out = _sweep(args, tmp_path, _env(fake_bin)).stdout
    assert "submit it with sbatch" in out and not results.exists()
    text = script.read_text()
    assert "#SBATCH --nodes=1" in text and "#SBATCH --ntasks-per-node=2" in text and "#SBATCH --partition=gpu" in text
    assert "--launcher srun" in text and "--sbatch" not in text.split("--launcher srun", 1)[1]
    proc = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, env=_env(fake_bin),
                          cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (record,) = _latest(results).values()
    assert record["status"] == "ok" and record["launcher"] == "srun" and record["layout"]["pp"] == 2
    with open(record["log"]) as f:
        log = f.read()
    assert log.startswith("$ srun --nodes 1 --ntasks 2") and "fake srun: 2 tasks" in log


@pytest.mark.slow
def test_crash_hang_and_oom_do_not_stop_the_sweep(tmp_path, fake_bin):
    pids = tmp_path / "pids"
    pids.mkdir()
    results = tmp_path / "faults.jsonl"
    args = ["--launcher", "srun", "--nproc-per-node", "2", "--script", os.path.join(HERE, "fake", "fake_trainer.py"),
            *TINY, "--seed", "2,3,4,1", "--trial-iters", "4", "--warmup-iters", "1", "--trial-timeout", "6",
            "--kill-grace", "1", "--results", str(results)]
    env = _env(fake_bin, slurm=True, FAKE_PID_DIR=str(pids))
    out = _sweep(args, tmp_path, env).stdout
    status = {r["argv"][r["argv"].index("--seed") + 1]: r for r in _latest(results).values()}
    assert {s: r["status"] for s, r in status.items()} == {"2": "crash", "3": "hang", "4": "oom", "1": "ok"}, out
    assert status["2"]["reason"] == "error: --data-path missing_text_document: no such file"
    assert status["3"]["reason"].startswith("still running after 6 s (last iteration logged: 1)")
    assert "CUDA out of memory" in status["4"]["reason"]
    assert status["1"]["median_iteration_s"] == pytest.approx(0.013)  # iterations 2..4 log 12, 13, 14 ms
    assert status["1"]["peak_memory_bytes"] == 1001
    assert len(os.listdir(pids)) >= 8 and _all_die([int(p) for p in os.listdir(pids)])
    # --retry runs the hung trial again, and only it
    out = _sweep(args + ["--retry", "hang"], tmp_path, env).stdout
    assert "1 to go" in out
    hang = [r for r in _records(results) if r["id"] == status["3"]["id"] and r["status"] != "running"]
    assert [r["attempt"] for r in hang] == [1, 2]


@pytest.mark.slow
def test_torchrun_hang_kills_every_worker(tmp_path):
    """torchrun starts each worker in a session of its own: a hung trial's workers must die with it."""
    pids = tmp_path / "pids"
    pids.mkdir()
    results = tmp_path / "hang.jsonl"
    args = ["--nproc-per-node", "2", "--script", os.path.join(HERE, "fake", "fake_trainer.py"), *TINY,
            "--seed", "3", "--trial-iters", "4", "--warmup-iters", "1", "--trial-timeout", "12", "--kill-grace", "1",
            "--results", str(results)]
    _sweep(args, tmp_path, _env(FAKE_PID_DIR=str(pids)))
    (record,) = _latest(results).values()
    assert record["status"] == "hang" and record["iterations"] == 1
    workers = [int(p) for p in os.listdir(pids)]
    assert len(workers) == 2 and _all_die(workers)


def _wait_for(path, predicate, timeout=60.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if path.exists() and predicate(_records(path)):
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting on {path}")


@pytest.mark.slow
def test_kill_and_resume(tmp_path, fake_bin):
    """SIGKILL the sweep while its second trial runs; the next sweep skips the first and runs the other two."""
    results = tmp_path / "resume.jsonl"
    args = ["--launcher", "srun", "--nproc-per-node", "2", "--script", os.path.join(HERE, "fake", "fake_trainer.py"),
            *TINY, "--seed", "1,5,6", "--trial-iters", "4", "--warmup-iters", "1", "--results", str(results)]
    env = _env(fake_bin, slurm=True, FAKE_ITER_S="0.3")
    sweep = subprocess.Popen([sys.executable, TOOL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env=env, cwd=tmp_path)
    _wait_for(results, lambda rs: [r["status"] for r in rs] == ["running", "ok", "running"])
    sweep.kill()
    sweep.wait()
    first, _, second = _records(results)
    out = _sweep(args, tmp_path, env).stdout
    assert "3 trials: 0 infeasible, 1 already in" in out and "2 to go" in out
    latest = _latest(results)
    assert all(r["status"] == "ok" for r in latest.values()) and len(latest) == 3
    assert latest[first["id"]]["attempt"] == 1 and latest[second["id"]]["attempt"] == 2
    assert sum(1 for r in _records(results) if r["id"] == first["id"]) == 2  # never started again


@pytest.mark.slow
def test_sigterm_takes_the_running_trial_down(tmp_path, fake_bin):
    pids = tmp_path / "pids"
    pids.mkdir()
    results = tmp_path / "term.jsonl"
    args = ["--launcher", "srun", "--nproc-per-node", "2", "--script", os.path.join(HERE, "fake", "fake_trainer.py"),
            *TINY, "--seed", "3", "--trial-iters", "4", "--warmup-iters", "1", "--results", str(results)]
    sweep = subprocess.Popen([sys.executable, TOOL, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=_env(fake_bin, slurm=True, FAKE_PID_DIR=str(pids)), cwd=tmp_path)
    t0 = time.time()
    while len(os.listdir(pids)) < 2 and time.time() - t0 < 30:
        time.sleep(0.05)
    time.sleep(0.3)
    sweep.send_signal(signal.SIGTERM)
    assert sweep.wait(timeout=30) == 128 + signal.SIGTERM
    said = sweep.stderr.read().strip().splitlines()
    assert said == [f"sweep stopped by SIGTERM; finished trials are kept in {results}: run the same command again "
                    "to resume"], said
    assert _all_die([int(p) for p in os.listdir(pids)])
    assert [r["status"] for r in _records(results)] == ["running"]  # unfinished: the next sweep runs it
