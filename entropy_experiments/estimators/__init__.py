"""The probe's estimators (docs/maths.md §3–§6), pure functions of tensors and per-sequence arrays.

`objectives` (the trainers' objectives L_U), `surrogate` (the entropy surrogate L_X on E),
`adam_state` (the saved AdamW state and hyperparameters) and `update_direction` (v from them),
`snis` (SNIS ΔH(η), weight diagnostics, linearity) and `jackknife` (SE_E, SE_U, SE_total).
"""
