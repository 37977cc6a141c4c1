"""Grid search: run configurations (a grid of pretrain_gpt.py flags, or planner plans) for real, resumably.

    python tools/grid_search.py --nproc-per-node 4 --tensor-model-parallel-size 1,2 --micro-batch-size 1,2 \\
        --num-layers 8 --hidden-size 256 --num-attention-heads 4 --seq-length 128 --global-batch-size 16 \\
        --mock-data --vocab-size 1024 --trial-iters 10 --warmup-iters 3 --trial-timeout 600 \\
        --results sweep.jsonl [--predict --cluster local --profile prof.json]
    python tools/grid_search.py --plans plans/ --mock-data --results plans.jsonl
    python tools/grid_search.py --sbatch sweep.sbatch --nnodes 2 --nproc-per-node 8 <the same flags>

See megatron_bmw/trials/ and the README's "Grid search" section.
"""

from __future__ import annotations

import os
import sys

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.trials.cli import main

if __name__ == "__main__":
    sys.exit(main())
