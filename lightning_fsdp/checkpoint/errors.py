"""The one error type every checkpoint problem is reported as."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, verified or loaded.

    The message names the file or directory concerned and what to do about it. In a distributed run every rank
    raises the same error (the ranks agree on failures before raising), so no rank is left waiting in a collective.
    """
