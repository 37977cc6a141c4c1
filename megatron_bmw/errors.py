"""User-facing errors: entry points print them as one line and exit with a non-zero code, never a traceback.

- UsageError: bad input (a flag, a file, a layout), exit code 2.
- RunError: the run cannot go on (it diverged, a disk filled up), exit code 1.
- Reported: already printed by the rank that saw it (see parallel/agree.py); only exit with its code.
- A collective that timed out or lost its peer: the rank says which, in one line, exit code 1.

Before torch.distributed is initialised every rank meets the same bad input, so rank 0 prints. Under torchrun,
which stops every rank once one has failed, another rank that got there first waits REPORT_GRACE_S and then
prints the same line if it is still alive, so the line is not lost when rank 0 is the slow one. After
initialisation, errors can be one rank's own, so that rank prints with its rank number.
"""

import argparse
import os
import sys
import time

REPORT_GRACE_S = 5.0


class UsageError(Exception):
    """Bad input from the user (a flag, a file, a layout). The message is one line naming what is wrong."""

    exit_code = 2


class RunError(Exception):
    """The run stops (e.g. the loss diverged); every rank raises it together. One line, exit code 1."""

    exit_code = 1


class Reported(Exception):
    """Stop with `exit_code`; the message was printed already (by the rank that saw the error)."""

    def __init__(self, exit_code: int) -> None:
        super().__init__(exit_code)
        self.exit_code = exit_code


# Text of the errors torch.distributed raises when a peer died or stopped answering (gloo and NCCL).
_LOST_PEER = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "ProcessGroupNCCL", "Watchdog caught collective operation timeout")
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")


def lost_peer(exc: BaseException) -> bool:
    """Did a collective fail because another rank died or hung?"""
    if type(exc).__name__ in _DIST_ERRORS:
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in _LOST_PEER)


def _distributed() -> tuple[bool, int]:
    """(torch.distributed initialised, this rank); without importing torch where nothing did."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, int(os.environ.get("RANK", "0"))


def say(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)


def report(exc: BaseException) -> int:
    """Print `exc` as the policy above says; return the exit code."""
    initialised, rank = _distributed()
    if isinstance(exc, Reported):
        return exc.exit_code
    if isinstance(exc, UsageError):
        if not initialised:
            if rank != 0:
                if not os.environ.get("TORCHELASTIC_RUN_ID"):  # other launchers leave rank 0 to print
                    return exc.exit_code
                time.sleep(REPORT_GRACE_S)
            say(str(exc))
        else:
            say(f"rank {rank}: {exc}")
        return exc.exit_code
    if isinstance(exc, RunError):
        if rank == 0:
            say(str(exc))
        return exc.exit_code
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    say(f"rank {rank}: lost contact with another rank, which died or stopped responding ({first}); "
        "stopping (see that rank's own error, or raise --distributed-timeout-minutes if it was only slow)")
    return 1


def _exit(code: int) -> None:
    """Exit with `code`. Inside a process group, skip the interpreter's teardown: the groups still alive would be
    destroyed in it, and a gloo group destroyed there can abort the process (exit -6 instead of `code`)."""
    if _distributed()[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def exit_on_usage_error(fn):
    """Decorator for entry points: the errors above become one `error:` line and their exit code."""

    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (UsageError, RunError, Reported) as exc:
            _exit(report(exc))
        except KeyboardInterrupt:  # Ctrl-C before a handler of the entry point's own (pretrain's saves) was set
            if _distributed()[1] == 0:
                say("interrupted (SIGINT); stopped")
            _exit(130)
        except BrokenPipeError:  # the reader left (`... | head`): stop quietly, as a Unix tool does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except Exception as exc:  # noqa: BLE001 - only a lost peer becomes a line; anything else is a bug
            if not lost_peer(exc):
                raise
            _exit(report(exc))

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class OneLineParser(argparse.ArgumentParser):
    """argparse with the policy above: a bad flag is one line and exit code 2, said once (every rank parses the
    same flags), not a usage block."""

    def error(self, message: str):
        sys.exit(report(UsageError(message)))
