"""Legacy import path of the original (seed) API: `ProbeComponents`, a thin re-export of
`entropy_experiments.compat.probe_components`. New code calls the phase functions of `entropy_experiments.probe.recipe`."""

from .compat.probe_components import *  # every legacy name: the list is compat.probe_components.__all__
from .compat.probe_components import __all__  # noqa: F401
