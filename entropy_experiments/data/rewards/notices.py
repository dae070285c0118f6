"""Once-per-process reward warnings, kept so that the probe can copy them into results.json.

A problem that affects every sample (e.g. gold answers missing from the data set) must be visible
but must not flood the log with one line per response.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("entropy_experiments.rewards")

_WARNED: dict[str, str] = {}  # key -> message, in the order first raised


def warn_once(key: str, message: str) -> None:
    """Log `message` as a warning the first time `key` is seen in this process; later calls do nothing."""
    if key in _WARNED:
        return
    _WARNED[key] = message
    logger.warning(message)


def reward_warnings() -> list[str]:
    """The warnings raised so far in this process, oldest first."""
    return list(_WARNED.values())


def clear_reward_warnings() -> None:
    """Forget past warnings so that they are raised again (tests; a new run in the same process)."""
    _WARNED.clear()
