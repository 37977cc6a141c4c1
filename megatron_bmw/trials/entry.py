"""What a trial runs on every rank: pretrain_gpt.py, then one line with the rank's peak memory.

    python -m megatron_bmw.trials.entry <pretrain_gpt.py flags>

The line is ` trial memory | rank R | stage S | peak allocated B | peak reserved B | device used B` (CUDA:
torch's peak allocation and reservation, and the device's used memory, which adds the context and other
processes) or ` ... | peak allocated B | peak rss B` (CPU: the model states plus the activation store's peak, when
the run keeps a store; and the process's peak resident memory, all it held).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ..errors import exit_on_usage_error
from ..training.pretrain import pretrain


def memory_line(trainer) -> str:
    st = trainer.state
    fields = [f"peak allocated {int(trainer.memory_in_use())}"]
    if st.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(st.device)
        fields += [f"peak reserved {int(torch.cuda.max_memory_reserved(st.device))}", f"device used {total - free}"]
    else:
        import resource

        fields.append(f"peak rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}")  # Linux: KiB
    return f" trial memory | rank {st.rank} | stage {st.pp_rank} | " + " | ".join(fields)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> None:
    trainer = pretrain(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.write(memory_line(trainer) + "\n")  # one write: ranks share the log, a line must not split
    sys.stdout.flush()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
