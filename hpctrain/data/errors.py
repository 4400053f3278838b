"""Errors for bad data: one exception type per problem, each naming the file and the key.

Every error is a :class:`DataError`, which is a :class:`ValueError` (bad user input), and
says what was seen, what was expected and what to do (``HINT:`` lines).
"""
from __future__ import annotations

from typing import Optional


class DataError(ValueError):
    """Bad input data. ``path`` and ``key`` name the file and dataset concerned (or None)."""

    def __init__(self, message: str, path: Optional[str] = None, key: Optional[str] = None,
                 hint: Optional[str] = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}"
            if key is not None:
                where += f" [key {key!r}]"
            where += ": "
        elif key is not None:
            where = f"key {key!r}: "
        text = where + message
        if hint:
            text += "\nHINT: " + hint
        super().__init__(text)
        self.path = path
        self.key = key
        self.hint = hint


class MissingFileError(DataError):
    """The file does not exist."""


class NotHDF5Error(DataError):
    """The file exists but does not carry the HDF5 signature."""


class CorruptFileError(DataError):
    """HDF5 could not read the file: truncated, damaged, or a checksum (fletcher32) failed."""


class FilterUnavailableError(DataError):
    """A dataset's filter (compression plugin) is not available to this HDF5: the file is fine."""


class PermissionDeniedError(DataError):
    """The file exists but this process may not read (or write) it."""


class MissingKeyError(DataError):
    """A requested key is not in the file (or is a group, not a dataset)."""


class LengthMismatchError(DataError):
    """Keys of one file, or the same key across files, disagree in sample count or shape."""


class EmptyDataError(DataError):
    """A file or dataset has zero samples."""


class TooFewSamplesError(DataError):
    """Fewer samples than ranks x batch size: some rank would get no full step."""


class DtypeError(DataError):
    """A dataset is not numeric (strings, objects, compound types...)."""


class ChecksumError(DataError):
    """Stored content checksums do not match the data."""


class ConfigError(DataError):
    """A bad argument (policy, weights, batch size...) rather than bad data."""
