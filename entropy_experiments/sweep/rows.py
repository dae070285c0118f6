"""sweep.json's `rows` (one per checkpoint) and `realised` (one per pair of consecutive checkpoints).

Everything here is read back from the checkpoints' run directories (results.json or entropy_only.json, and
per_sequence.jsonl), so sweep.json can be rebuilt from them at any time. Units: entropies in nats per token
(`per_token`) or per sequence (`per_sequence`), the run's `normalize`; lr per the optimizer's lr.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..checkpoint.rollouts import NUM_ITERATIONS_KEY
from ..checkpoint.trainer_batch import recorded_trainer_batch
from ..errors import OutputError
from ..estimators.entropy_proxies import PROXIES
from ..estimators.jackknife import entropy_with_se
from ..report.results_schema import upgrade_results
from ..report.run_dir import PER_SEQUENCE_FILE
from .decomposition import interval_decomposition
from .discovery import SweepCheckpoint
from .realised import interval_realised_change

__all__ = ["ENTROPY_ONLY_FILE", "CheckpointRun", "checkpoint_row", "interval_prediction", "read_run", "realised_rows"]

ENTROPY_ONLY_FILE = "entropy_only.json"
RESULTS_FILE = "results.json"
NAN = float("nan")


@dataclass
class CheckpointRun:
    """A finished run directory: results.json (full probe) or entropy_only.json, and E's per-sequence h, T, prompt."""

    path: Path
    kind: str                 # "probe" | "entropy_only"
    results: dict
    h: np.ndarray             # nats per sequence
    T: np.ndarray             # tokens
    slots: list[int]          # the E prompt draw (prompt_index) of each sequence: the probe's jackknife unit
    prompt_ids: list          # the data set prompt of that draw
    columns: dict[str, np.ndarray] = field(default_factory=dict)  # optional per-sequence columns (_columns_of)
    sampler_log_weight: np.ndarray | None = None  # log s_i when E was drawn by another sampler (docs/maths.md §12)

    def d(self, normalize: str) -> np.ndarray:
        """The denominator of Ĥ per sequence: T (per_token) or 1 (per_sequence)."""
        return self.T if normalize == "per_token" else np.ones_like(self.T)

    @property
    def sampler_weights(self) -> np.ndarray | None:
        """The sampler correction's s_i ∝ q_θ/q_sampler of each sequence, scaled so that the largest is 1 (every
        statistic here is a ratio of sums over one batch: the scale cancels); None: E was drawn by the policy."""
        lw = self.sampler_log_weight
        return None if lw is None else np.exp(lw - lw.max())

    @property
    def pair_keys(self) -> list[str]:
        """The pairing unit of each sequence: its draw and prompt; a draw pairs across checkpoints when both match."""
        return [f"{slot}:{pid}" for slot, pid in zip(self.slots, self.prompt_ids, strict=True)]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OutputError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc


def _columns_of(lines: list[dict]) -> dict[str, np.ndarray]:
    """The pieces a, r along v ("a", "r") and the displacement's per-sequence columns ("displacement.a", …),
    where every row has them."""
    out = {}
    if all("a" in r for r in lines):
        out.update(a=np.array([float(r["a"]) for r in lines]), r=np.array([float(r["r"]) for r in lines]))
    if all("displacement" in r for r in lines):
        for key in lines[0]["displacement"]:
            out[f"displacement.{key}"] = np.array([float(r["displacement"][key]) for r in lines])
    return out


def read_run(run_dir: Path) -> CheckpointRun:
    """The finished run in `run_dir` (OutputError naming the file when something is missing or unreadable)."""
    if (run_dir / RESULTS_FILE).is_file():
        kind, results = "probe", upgrade_results(_read_json(run_dir / RESULTS_FILE))
    elif (run_dir / ENTROPY_ONLY_FILE).is_file():
        kind, results = "entropy_only", _read_json(run_dir / ENTROPY_ONLY_FILE)
    else:
        raise OutputError(f"run directory {run_dir} holds neither {RESULTS_FILE} nor {ENTROPY_ONLY_FILE}")
    path = run_dir / PER_SEQUENCE_FILE
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        h = np.array([float(r["h"]) for r in lines])
        T = np.array([float(r["T"]) for r in lines])
        slots = [int(r["prompt_index"]) for r in lines]
        prompts = [r["prompt_id"] for r in lines]
        columns = _columns_of(lines)
        log_s = (np.array([float(r["sampler_log_weight"]) for r in lines])
                 if lines and all("sampler_log_weight" in r for r in lines) else None)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
    if not lines:
        raise OutputError(f"{path} holds no sequences")
    return CheckpointRun(run_dir, kind, results, h, T, slots, prompts, columns, log_s)


def _num(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def predictors_of(results: dict) -> dict[str, dict]:
    """{name: {delta_h1, se, se_E, se_U, residual_z}} from results.json `predictors` (residual_z: the z of the
    predictor's paired residual against ΔH, None where it has none), or adamw_step = (deltaH1, se) alone."""
    found = dict(results.get("predictors") or {})
    if not set(found) - {"displacement"}:  # predictors off: the probe's δH₁ (and the displacement if measured)
        se = results.get("se") or {}
        found["adamw_step"] = {"delta_h1": results.get("deltaH1"), "se": se.get("total"), "se_E": se.get("E"),
                               "se_U": se.get("U")}
    return {name: {**{k: _num(p.get(k)) for k in ("delta_h1", "se", "se_E", "se_U")},
                   "residual_z": _num((p.get("residual") or {}).get("z"))} for name, p in found.items()}


@dataclass(frozen=True)
class SmallestEtaTruth:
    """ΔH at the smallest positive η of a run, with its SE, and both scaled by lr/η (comparable with δH₁)."""

    eta: float
    value: float
    se: float | None
    scaled: float
    se_scaled: float | None


def smallest_eta_truth(results: dict, lr: float) -> tuple[SmallestEtaTruth | None, float | None]:
    """(deltaH_true at the smallest positive η with its SE and both scaled by lr/η, that η's paired residual z)."""
    rows = [r for r in results.get("true") or [] if r.get("eta", 0) > 0 and _num(r.get("deltaH_true")) is not None]
    if not rows:
        return None, None
    row = min(rows, key=lambda r: r["eta"])
    eta, value, se = float(row["eta"]), float(row["deltaH_true"]), _num(row.get("se"))
    scale = lr / eta
    truth = SmallestEtaTruth(eta, value, se, value * scale, None if se is None else se * scale)
    return truth, _num((row.get("residual") or {}).get("z"))


def _z(diff: float | None, *ses: float | None) -> float | None:
    if diff is None or any(s is None for s in ses):
        return None
    total = math.sqrt(sum(s * s for s in ses))
    return diff / total if total > 0 else None


def _with_z_own(preds: dict[str, dict], truth: SmallestEtaTruth | None, residual_z: float | None) -> dict[str, dict]:
    """Each predictor's z against ΔH(η)·lr/η, measured − predicted: adamw_step's is the probe's paired residual z
    (same E, same v), the others' their own paired residual's (one jackknife over E with ΔH, results.json
    `predictors.<name>.residual`) where the run has it (`z_own_paired` true); else (δ − ΔH·lr/η) over
    √(SE_E² + SE(ΔH·lr/η)²), the two E errors taken as independent (too wide when they are correlated). The U
    error, shared with ΔH's in part, is left out of both."""
    for name, p in preds.items():
        paired = residual_z if name == "adamw_step" else p["residual_z"]
        del p["residual_z"]
        p["z_own"], p["z_own_paired"] = None, paired is not None
        if truth is None:
            p["z_own_paired"] = False
        elif paired is not None:
            p["z_own"] = paired
        else:
            diff = None if p["delta_h1"] is None else truth.scaled - p["delta_h1"]
            p["z_own"] = _z(diff, p["se_E"], truth.se_scaled)
    return preds


def no_step_kind(reason: str) -> str:
    """Why an entropy-only row has no δH₁, for its label: 'reuses_rollouts' (the next step is off-policy),
    'schedule_ended' (saved lr 0.0) or 'no_next_step'."""
    if reason.startswith(NUM_ITERATIONS_KEY):
        return "reuses_rollouts"
    return "schedule_ended" if "schedule that ended" in reason else "no_next_step"


def checkpoint_row(ck: SweepCheckpoint, run: CheckpointRun, normalize: str, sweep_dir: Path) -> dict:
    """One `rows` entry: the checkpoint, its Ĥ ± SE, δH₁ and its SEs, ΔH at the smallest η, the predictors."""
    H = entropy_with_se(run.h, run.d(normalize), run.slots, run.sampler_weights)
    row = {"checkpoint": ck.name, "step": ck.step, "step_source": ck.step_source, "kind": run.kind,
           "run_dir": str(run.path.relative_to(sweep_dir)), "H": _num(H.value), "H_se": _num(H.se),
           "n_sequences": int(run.h.size), "n_units": len(set(run.slots)),
           "n_distinct_prompts": len(set(map(str, run.prompt_ids)))}
    row["trainer_batch_sequences"], row["trainer_batch_source"] = recorded_trainer_batch(ck.path)
    res = run.results
    if run.kind == "entropy_only":
        return {**row, "lr": _num(res.get("learning_rate")), "deltaH1": None, "se_total": None, "se_E": None,
                "se_U": None, "deltaH_true": None, "residual_z": None, "predictors": {},
                "no_prediction": res["reason"], "no_step": no_step_kind(res["reason"])}
    lr = float(res["learning_rate"])
    truth, residual_z = smallest_eta_truth(res, lr)
    se = res.get("se") or {}
    return {**row, "lr": lr, "deltaH1": _num(res["deltaH1"]), "se_total": _num(se.get("total")),
            "se_E": _num(se.get("E")), "se_U": _num(se.get("U")), "deltaH_true": None if truth is None else asdict(truth), "residual_z": residual_z,
            "predictors": _with_z_own(predictors_of(res), truth, residual_z), "no_prediction": None}


def interval_prediction(row_from: dict, steps: int) -> dict[str, dict]:
    """Per predictor: the prediction of a change over `steps` training steps from `row_from`'s δH₁ (times
    `steps`: δH₁ held constant over steps that have no probe), its SE, and z against the realised change. A
    scale-free proxy (a change per unit logit step) is multiplied by the lr of those steps as well (Σ lr =
    steps × the `from` lr), so that one fitted scale can hold across a schedule (calibration.py)."""
    se_batch = None if row_from["se_U"] is None else row_from["se_U"] * math.sqrt(steps)
    out = {}
    for name, p in row_from["predictors"].items():
        if name == "displacement":  # a change over the interval already (Δθ spans its steps): realised_rows
            continue
        per_step = 1.0 if name not in PROXIES else row_from["lr"]
        pred = None if p["delta_h1"] is None else steps * per_step * p["delta_h1"]
        se_pred = None if p["se"] is None else steps * p["se"]
        out[name] = {"dH_predicted": pred, "se": se_pred, "se_batch": se_batch, "z": None}
    return out


def realised_rows(rows: list[dict], runs: list[CheckpointRun], normalize: str,
                  crosses: list | None = None) -> tuple[list[dict], list[str]]:
    """(one entry per consecutive pair (from, to) of swept checkpoints, warnings): the realised change with its
    SE (realised.py: importance weights both ways where `crosses[i]` — cross_scores.read_cross_scores of
    interval i — is there and the weights hold, else two independent-batch entropies; the paired difference as
    `paired_diagnostic` only), the prediction(s) from `from` and z = (realised − predicted)/√(se² + se_pred² +
    se_batch²); the displacement predictor's z is the first-order residual's (realised − δH_Δθ with the same
    realised change, one jackknife over both batches), and the decomposition (decomposition.py) rides along."""
    out, warnings = [], []
    pairs = list(itertools.pairwise(zip(rows, runs, strict=True)))
    for i, ((a, run_a), (b, run_b)) in enumerate(pairs):
        cross = None if crosses is None else crosses[i]
        change, said = interval_realised_change(run_a, run_b, normalize, cross, f"{a['step']}→{b['step']}")
        warnings += said
        steps = b["step"] - a["step"]
        real, se_real = change["dH_realised"], change["se"]
        preds = interval_prediction(a, steps)
        for p in preds.values():
            p["z"] = _z(None if p["dH_predicted"] is None or real is None else real - p["dH_predicted"],
                        se_real, p["se"], p["se_batch"])
        parts = interval_decomposition(a, run_a, run_b, steps, normalize, cross=cross, method=change["method"])
        if parts["displacement"] is not None:
            first = parts["first_order"] or {}
            preds = {"displacement": {"dH_predicted": parts["displacement"]["value"],
                                      "se": parts["displacement"]["se"], "se_batch": None, "z": first.get("z")},
                     **preds}
        main = preds.get("adamw_step", {})
        out.append({"from_checkpoint": a["checkpoint"], "to_checkpoint": b["checkpoint"], "from_step": a["step"],
                    "to_step": b["step"], "steps": steps, **change,
                    "dH_predicted": main.get("dH_predicted"), "se_predicted": main.get("se"),
                    "se_batch": main.get("se_batch"), "z": main.get("z"),
                    "extrapolated_steps": max(steps - 1, 0) if preds else 0,
                    "predictors": preds, "no_prediction": a["no_prediction"], **parts})
    return out, warnings
