"""`entropy-probe sweep`: the probe on every checkpoint of a training run, checked against what the run did.

* `discovery`: the checkpoints in a directory (`checkpoint-N/`, `step_N/`), in step order;
* `policies`: one base model loaded once, each checkpoint's adapter and AdamW state put on it;
* `entropy_only`: Ĥ alone where no step follows (saved lr 0.0);
* `runner`: the loop, resumable (`run_sweep`); `sweep_dir`: the sweep directory;
* `rows`, `stats`, `calibration`: sweep.json (per checkpoint, per realised interval, per predictor);
* `plots`, `summary`: trajectory.png, calibration.png and the printed tables.
"""

from .runner import build_sweep_json, run_sweep

__all__ = ["build_sweep_json", "run_sweep"]
