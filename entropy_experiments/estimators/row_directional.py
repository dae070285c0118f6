"""Per-row directional derivatives ∇L_r · v collected for free during an ordinary backward pass.

The per-sequence pieces of the E-side error bars (docs/maths.md §6) are directional derivatives
D_v L_r = ∇_θ L_r · v of each sequence's share L_r of a loss L = Σ_r L_r. When every trainable
parameter is the weight (or bias) of an `nn.Linear` — true for LoRA, whose A and B matrices are
Linear layers — the gradient of that weight is a sum over tokens of outer products, so

    ∇_W L_r · V = Σ_{t in row r} g_t^T V x_t        (bias: Σ_t g_t · v_b)

with x_t the layer's input and g_t = ∂L/∂(output_t). Rows of a transformer batch do not interact,
so g_t for a token of row r only carries L_r. Forward hooks keep x, tensor hooks on the outputs see
g during the backward, and each backward adds a [R] vector of per-row dots — no forward-mode pass,
no per-sample gradients. The cost is one small matmul per adapted layer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Self

import torch
from torch import Tensor, nn


def linear_directions(model: nn.Module, v_named: Mapping[str, Tensor]) -> dict[nn.Linear, tuple[Tensor, Tensor | None]] | None:
    """Map each Linear owning a named parameter to (V_weight, V_bias) from `v_named`.

    Returns None when some parameter in `v_named` is not the weight or bias of an `nn.Linear`
    (e.g. an embedding or a DoRA magnitude): the caller must then use forward-mode AD instead.
    Every Linear that owns a trainable parameter must be covered, so that no gradient path is missed.
    """
    owners: dict[str, tuple[nn.Linear, str]] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            for attr in ("weight", "bias"):
                param = getattr(module, attr)
                if param is not None:
                    owners[f"{module_name}.{attr}" if module_name else attr] = (module, attr)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if set(v_named) != trainable:
        return None
    directions: dict[nn.Linear, list[Tensor | None]] = {}
    for name, v in v_named.items():
        if name not in owners:
            return None
        module, attr = owners[name]
        slot = directions.setdefault(module, [None, None])
        ref = getattr(module, attr)
        slot[0 if attr == "weight" else 1] = v.detach().to(device=ref.device, dtype=torch.float64)
    out = {}
    for module, (vw, vb) in directions.items():
        if vw is None:  # only the bias is trainable
            vw = torch.zeros_like(module.weight, dtype=torch.float64)
        out[module] = (vw, vb)
    return out


class RowDirectionalDerivatives:
    """Context manager: while active, each backward pass adds ∇L_r·v to `values[r]` for every batch row.

    Usage (one forward of R rows, any number of backward passes through its graph):

        with RowDirectionalDerivatives(directions) as rows:
            loss_a, loss_b = ...forward...
            rows.reset(R); torch.autograd.grad(loss_a, params, retain_graph=True); dots_a = rows.values
            rows.reset(R); torch.autograd.grad(loss_b, params);                    dots_b = rows.values

    `values` is float64 [R] (per unit of v). Not valid under gradient checkpointing (the recomputed
    forward would register its hooks a second time).
    """

    def __init__(self, directions: dict[nn.Linear, tuple[Tensor, Tensor | None]]):
        self.directions = directions
        self.values: Tensor | None = None
        self._handles: list = []

    def __enter__(self) -> Self:
        for module in self.directions:
            self._handles.append(module.register_forward_hook(self._on_forward))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def reset(self, num_rows: int) -> None:
        """Start a new backward: zero the [num_rows] accumulator."""
        self.values = torch.zeros(num_rows, dtype=torch.float64)

    def _on_forward(self, module: nn.Linear, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if not output.requires_grad:
            return
        x = inputs[0].detach()
        v_weight, v_bias = self.directions[module]
        out_features, in_features = v_weight.shape

        def on_grad(grad: Tensor) -> None:
            g = grad.detach()                                    # [R, ..., out]
            # g_tᵀ V x_t, contracted on the narrow side first (LoRA: rank r ≪ hidden size): the matmul
            # runs in the activations' dtype, the products and sums in float64.
            if in_features >= out_features:
                dots = (x @ v_weight.to(x.dtype).T).double() * g.double()       # [R, ..., out]
            else:
                dots = (g @ v_weight.to(g.dtype)).double() * x.double()          # [R, ..., in]
            per_row = dots.reshape(dots.shape[0], -1).sum(dim=1)
            if v_bias is not None:
                per_row = per_row + (g.double() @ v_bias).reshape(g.shape[0], -1).sum(dim=1)
            if self.values is None:
                raise RuntimeError("RowDirectionalDerivatives.reset(num_rows) must be called before backward")
            self.values += per_row.cpu()

        output.register_hook(on_grad)


@contextmanager
def many_row_directionals(directions: Mapping[str, dict[nn.Linear, tuple[Tensor, Tensor | None]]]
                          ) -> Iterator[dict[str, RowDirectionalDerivatives]]:
    """Several directions in the same backward passes: {key: RowDirectionalDerivatives} for each key's map
    (`linear_directions`). Each adds its own hooks, so every direction costs one small matmul per layer."""
    with ExitStack() as stack:
        yield {key: stack.enter_context(RowDirectionalDerivatives(d)) for key, d in directions.items()}
