"""Planner CLI: memory per stage, a simulated iteration, or a profile of this machine.

    python tools/autoconfig.py estimate --cluster a100-80g-ib --num-nodes 2 --num-layers 24 --hidden-size 2048 \\
        --num-attention-heads 16 --seq-length 2048 --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 4 --micro-batch-size 2 --global-batch-size 64 --bf16 [--json]
    python tools/autoconfig.py simulate ... [--profile prof.json] [--json] [--timeline iteration.png]
    python tools/autoconfig.py profile --output prof.json <model flags> [--profile-tp 1,2]

Takes the same model and parallelism flags as pretrain_gpt.py, plus --cluster NAME|FILE.
"""

from __future__ import annotations

import os
import sys

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_bmw.cli.autoconfig import main

if __name__ == "__main__":
    sys.exit(main())
