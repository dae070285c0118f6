"""User-facing error types.

Every mistake a user can make (bad config, missing checkpoint, malformed data, ...) raises a
subclass of `ProbeError` whose message is ONE line naming the key, path or value at fault.
The CLI turns a `ProbeError` into that line on stderr and exit code 2, with no traceback.
Programming errors (bugs) are left as ordinary exceptions so that they keep their traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class ProbeError(Exception):
    """Base class for errors caused by user input; the message is a single line."""

    exit_code: int = 2

    def __init__(self, message: str):
        # Guarantee the one-line contract even if a caller formats a multi-line message.
        super().__init__(" ".join(str(message).split("\n")))


class ConfigError(ProbeError):
    """A configuration key is missing, unknown, of the wrong type or out of range."""


class CheckpointError(ProbeError):
    """The adapter / base model / checkpoint directory cannot be used."""


class OptimizerStateError(ProbeError):
    """optimizer.pt is missing, unreadable, unsafe or does not match the model's parameters."""


class DataError(ProbeError):
    """A data set is unknown, missing, malformed, empty or too small for the request."""


class RewardError(ProbeError):
    """A reward spec cannot be resolved or a reward function returned bad values."""


class NumericsError(ProbeError):
    """Non-finite logits / losses; the message names the phase, batch and sequence."""


class DeviceError(ProbeError):
    """A requested device is unavailable or memory ran out beyond recovery."""


class OutputError(ProbeError):
    """The run directory cannot be written or holds a different run."""


def os_error_reason(err: OSError) -> str:
    """The OS's short reason for `err` (e.g. 'No space left on device'), for one-line messages."""
    return err.strerror or str(err)


@contextlib.contextmanager
def output_error_on_os_error(message: str) -> Iterator[None]:
    """Turn an OSError raised in the block into `OutputError(f"{message}: {reason}")`; others propagate."""
    try:
        yield
    except OSError as err:
        raise OutputError(f"{message}: {os_error_reason(err)}") from err


def closest_match(word: str, candidates: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """Return the candidate closest to `word` (difflib ratio ≥ 0.5), or None."""
    import difflib

    hits = difflib.get_close_matches(word, sorted(candidates), n=1, cutoff=0.5)
    return hits[0] if hits else None
