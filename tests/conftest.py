import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
torch.set_num_threads(1)


def pytest_terminal_summary(terminalreporter):
    """Threads per long-lived test worker at the end of the session: gloo groups that outlive their task show
    here as pt_gloo_runloop / gloo_tcp_loop threads."""
    from tests.dist_harness import worker_threads

    for ws, names in worker_threads().items():
        gloo = {k: v for k, v in names.items() if "gloo" in k}
        terminalreporter.write_line(f"dist workers, world size {ws}: {sum(names.values())} threads on rank 0 "
                                    f"(gloo: {gloo})")
