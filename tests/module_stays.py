"""Which of the project's modules a call runs through, in order: the "rooms" a reader of the code walks through.

A profiler hook (sys.setprofile) follows the innermost frame that lies in entropy_experiments/; library frames
(torch, transformers, peft) count as the project frame that called them. A *stay* is a maximal stretch spent in
one module; it begins by a call (the module is *entered*) or by a return (the code comes back to a module it
left). Used by tests/test_checkpoint_load_order.py and bench/load_reentries.py.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "entropy_experiments"


def module_of(filename: str) -> str | None:
    """'checkpoint.load' for entropy_experiments/checkpoint/load.py; None outside the package."""
    path = Path(filename)
    if not path.is_relative_to(PACKAGE):
        return None
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


@dataclass
class Stays:
    """The stays of one traced call: (module, how it began: 'call' | 'return'), in order."""

    stays: list[tuple[str, str]] = field(default_factory=list)

    def entries(self, module: str) -> int:
        """How often `module` was entered by a call from another module."""
        return sum(1 for m, how in self.stays if m == module and how == "call")

    def visits(self) -> Counter:
        return Counter(m for m, _ in self.stays)

    def returns(self) -> int:
        """Stays that come back to a module the code left before."""
        return sum(1 for m, how in self.stays if how == "return")

    def modules(self) -> list[str]:
        return [m for m, _ in self.stays]


class StayTracer:
    """`with StayTracer() as t: f()` records the stays of f in `t.result` (the first stay is f's own module)."""

    def __init__(self) -> None:
        self.result = Stays()

    def _enter(self, module: str | None, how: str) -> None:
        stays = self.result.stays
        if module is not None and (not stays or stays[-1][0] != module):
            stays.append((module, how))

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self._enter(module_of(frame.f_code.co_filename), "call")
        elif event == "return" and module_of(frame.f_code.co_filename) is not None:
            caller = frame.f_back
            while caller is not None and module_of(caller.f_code.co_filename) is None:
                caller = caller.f_back
            if caller is not None:
                self._enter(module_of(caller.f_code.co_filename), "return")

    def __enter__(self):
        sys.setprofile(self)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
