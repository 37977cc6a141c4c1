"""An sbatch script for a whole sweep: one allocation, the trials run one after another with srun inside it.
Resubmitting it resumes the sweep (trials already in the results file are skipped)."""

from __future__ import annotations

import os
import shlex

from ..errors import UsageError

TEMPLATE = """#!/bin/bash
# Grid search sweep written by tools/grid_search.py --sbatch; submit with: sbatch {name}
# Every trial runs with srun inside this allocation; resubmitting resumes the sweep from {results}.
#SBATCH --job-name={job}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={per_node}
#SBATCH --gpus-per-node={per_node}
#SBATCH --time={time}
#SBATCH --output={log}
{extra}set -euo pipefail
cd {workdir}
PYTHON_BIN=${{PYTHON_BIN:-{python}}}
"$PYTHON_BIN" {tool} --launcher srun --nnodes "${{SLURM_NNODES:-{nodes}}}" {args}
"""


def sbatch_script(path: str, sweep_args: list[str], nodes: int, per_node: int, time_limit: str, results: str,
                  python: str, options: list[str], workdir: str, tool: str) -> str:
    """The script's text; `sweep_args` are grid_search.py's arguments minus --sbatch and the launcher's."""
    extra = "".join(f"#SBATCH {o}\n" for o in options)
    stem = os.path.splitext(os.path.basename(path))[0]
    return TEMPLATE.format(name=os.path.basename(path), results=results, job=stem, nodes=nodes, per_node=per_node,
                           time=time_limit, log=f"{stem}-%j.out", extra=extra, workdir=shlex.quote(workdir),
                           python=shlex.quote(python), tool=shlex.quote(tool), args=" ".join(shlex.quote(a) for a in sweep_args))


def write_sbatch(path: str, text: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o755)
    except OSError as exc:
        raise UsageError(f"--sbatch {path}: cannot write it ({exc.strerror})") from None
