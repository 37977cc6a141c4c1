"""A stand-in for pretrain_gpt.py in sweep tests (no torch): prints Megatron's iteration lines from the last
rank. --seed picks what it does: 2 crashes with an `error:` line, 3 hangs, 4 runs out of memory, anything else
trains. FAKE_ITER_S sets the seconds per iteration (scaled by a --plan's layout); FAKE_PID_DIR, when set, gets a
file per process."""

import os
import sys
import time


def flag(name, default):
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1] if name in argv else default


rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
if os.environ.get("FAKE_PID_DIR"):
    open(os.path.join(os.environ["FAKE_PID_DIR"], str(os.getpid())), "w").close()
seed, iters = int(flag("--seed", "1")), int(flag("--train-iters", "5"))
step = float(os.environ.get("FAKE_ITER_S", "0.01"))
if "--plan" in sys.argv:  # a plan's time: slower with larger micro-batches and with ZeRO-1; FAKE_OOM_MBS: OOM
    import json

    with open(flag("--plan", "")) as f:
        plan = json.load(f)
    mbs = plan["pipeline"]["micro_batch_size"]
    step *= 1 + 0.1 * mbs + (0.2 if plan["training"].get("distributed_optimizer") else 0.0)
    if str(mbs) == os.environ.get("FAKE_OOM_MBS"):
        seed = 4
if seed == 2:
    print("error: --data-path missing_text_document: no such file", file=sys.stderr, flush=True)
    sys.exit(2)
if seed == 4:
    print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", file=sys.stderr, flush=True)
    sys.exit(1)
for i in range(1, iters + 1):
    time.sleep(step)
    if rank == world - 1:
        print(f" [2026-01-01 00:00:0{i % 10}] iteration {i:8d}/{iters:8d} | consumed samples: {4 * i:12d} | "
              f"elapsed time per iteration (ms): {1000 * step + i:.1f} | throughput per GPU (TFLOP/s/GPU): 1.5 | "
              f"learning rate: 1.000000E-04 | global batch size:     4 | lm loss: 5.0E+00 | loss scale: 1.0 |",
              flush=True)
    if seed == 3 and i == 1:
        while True:
            time.sleep(1)
print(f" trial memory | rank {rank} | stage {rank} | peak allocated {1000 + rank}", flush=True)
