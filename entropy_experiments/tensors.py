"""Tensors by parameter name: the one type of every direction, gradient and displacement of the probe."""

from __future__ import annotations

from torch import Tensor

NamedTensors = dict[str, Tensor]
