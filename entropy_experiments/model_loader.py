"""Legacy import path of the original (seed) API: `entropy_experiments.model_loader`, a thin re-export of
`entropy_experiments.compat.model_loader`. New code imports from `entropy_experiments.checkpoint`."""

from .compat.model_loader import *  # every legacy name: the list is compat.model_loader.__all__
from .compat.model_loader import __all__  # noqa: F401
