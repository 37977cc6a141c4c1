import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
torch.set_num_threads(1)

from tests.tiers import FAST  # noqa: E402

if FAST:  # matplotlib builds its font cache on first use by starting fc-list: here, before processes are refused
    try:
        import matplotlib

        matplotlib.use("Agg")
        from matplotlib import font_manager  # noqa: F401
    except ImportError:  # plots are optional
        pass


_THREADS: dict[int, dict[str, int]] = {}


def pytest_sessionfinish(session, exitstatus):
    """Note the worker pools' threads, then stop the pools: here, not only at exit, since a pytest-xdist worker has
    10 s after reporting its end before execnet calls os._exit, which skips atexit handlers and would orphan
    them."""
    harness = sys.modules.get("tests.dist_harness")
    if harness is not None:
        _THREADS.update(harness.worker_threads())
        harness.shutdown_pools()


def pytest_terminal_summary(terminalreporter):
    """Threads per long-lived test worker at the end of the session: gloo groups that outlive their task show
    here as pt_gloo_runloop / gloo_tcp_loop threads."""
    for ws, names in sorted(_THREADS.items()):
        gloo = {k: v for k, v in names.items() if "gloo" in k}
        terminalreporter.write_line(f"dist workers, world size {ws}: {sum(names.values())} threads on rank 0 "
                                    f"(gloo: {gloo})")


@pytest.fixture(autouse=True)
def _no_subprocess_in_the_fast_tier(request, monkeypatch):
    """In the fast tier a test that starts a process (an entry point, torchrun, a tool) fails with the reason: mark
    it slow. run_distributed refuses the same way (dist_harness.py)."""
    if not FAST or request.node.get_closest_marker("slow") is not None:
        return
    import subprocess

    real = subprocess.Popen

    class Refused(real):
        def __init__(self, args, *a, **k):
            raise RuntimeError(f"{request.node.nodeid} starts a process ({args!r:.80}): mark it @pytest.mark.slow")

    monkeypatch.setattr(subprocess, "Popen", Refused)
