"""Errors of the host-staged collectives. Every one names the rank it is about where there is one."""

from __future__ import annotations

from glmctl.errors import GlmctlError


class CollectiveError(GlmctlError):
    """A host-staged collective cannot go on; the communicator is unusable after it."""

    def __init__(self, message: str, hint: str | None = None, *, rank: int | None = None) -> None:
        super().__init__(message, hint)
        self.rank = rank  # the peer that caused it, when one did


class PeerLostError(CollectiveError):
    """A peer rank exited, closed its communicator or stopped making progress."""


class SegmentError(CollectiveError):
    """The shared host segment could not be created, found, mapped or registered."""


class CaptureMismatchError(CollectiveError):
    """Ranks captured different sequences of collectives into their CUDA graphs."""
