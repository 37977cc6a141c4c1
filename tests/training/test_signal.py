import os
import signal

from megatron_bmw.training.loop import _Signal


def test_sigterm_sets_the_flag_while_training_and_the_old_handler_is_back_after():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda *a: seen.append("old"))
    try:
        with _Signal() as sig:
            os.kill(os.getpid(), signal.SIGTERM)
            assert sig.received and seen == []
        os.kill(os.getpid(), signal.SIGTERM)
        assert seen == ["old"]
    finally:
        signal.signal(signal.SIGTERM, previous)
