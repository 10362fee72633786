"""
core/errors.py -- the exceptions every script shares, and nothing else, so the shared GPT
(model.py) can raise a user's mistake without importing the run-time machinery:

  - UserError:   a mistake the user can fix (bad flag, missing file, bad shape); run_cli
                 (core/runtime.py) prints it as one `error:` line and exits 2;
  - Interrupted: a graceful stop on SIGINT/SIGTERM (core/runtime.py's GracefulStop); run_cli
                 exits 128 + the signal number;
  - CollectiveFailure: a collective that timed out or lost its peer, in one line naming the
                 peers that look stopped (core/distributed.py); run_cli exits 3.
"""
import signal


class UserError(ValueError):
    """A mistake the user can fix (bad flag, missing file, bad shape). Scripts print its
    message in one line instead of a traceback (see `run_cli`)."""


class Interrupted(Exception):
    """Raised after a graceful stop on a signal (see GracefulStop): run_cli exits with the
    shell's convention, 128 + the signal number (SIGINT 130, SIGTERM 143)."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


class CollectiveFailure(Exception):
    """A collective waited longer than the process group's timeout, or its peer vanished:
    one line saying which rank, which collective and which peers look stopped. run_cli
    prints it on every surviving rank and exits 3, so torchrun --max-restarts restarts the
    group (see core/distributed.py)."""
