import os
import signal

import pytest

from megatron_bmw.training.loop import _Signal


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_flag_while_training_and_the_old_handler_is_back_after(signum):
    seen = []
    previous = signal.signal(signum, lambda *a: seen.append("old"))
    try:
        with _Signal() as sig:
            os.kill(os.getpid(), signum)
            assert sig.received and seen == []
        os.kill(os.getpid(), signum)
        assert seen == ["old"]
    finally:
        signal.signal(signum, previous)
