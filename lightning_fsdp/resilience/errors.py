"""The errors and exit codes of failure handling: what every rank raises when the ranks agreed something is wrong."""

from __future__ import annotations

#: Exit status after a preemption save: "temporary failure, try again" (sysexits ``EX_TEMPFAIL``). The SLURM
#: script requeues on it; ``torchrun --max-restarts=N`` restarts on any non-zero status.
PREEMPTED_EXIT_CODE = 75
#: Exit status of a rank ended because another rank failed.
PEER_FAILED_EXIT_CODE = 1


class AgreedError(RuntimeError):
    """Raised by every rank at the same point (they agreed on it): only rank 0 prints the traceback."""


class UnevenBatchesError(AgreedError):
    """Ranks have different numbers of batches: some would wait forever in a collective the others never join."""


class NonFiniteStepsError(AgreedError):
    """Too many consecutive optimizer steps had a NaN/inf loss or gradient norm."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete within the process-group timeout; the message names the operation."""


class PartialFailureError(RuntimeError):
    """A collective was requested while handling an exception, but not every rank failed: it would hang."""


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint is saved; the process exits with ``PREEMPTED_EXIT_CODE``."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message
