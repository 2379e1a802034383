"""The base of taskpoint's stream wrappers: one-way, unseekable views over a stream they do
not own (closing the wrapper leaves the wrapped stream to its owner)."""

from __future__ import annotations

__all__ = ["ReadView", "WriteView"]


class _View:
    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        """Does nothing: the owner of the wrapped stream closes it."""


class ReadView(_View):
    """A read-only view; subclasses provide ``read``."""

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False


class WriteView(_View):
    """A write-only view; subclasses provide ``write`` and ``flush``."""

    def readable(self) -> bool:
        return False

    def writable(self) -> bool:
        return True
