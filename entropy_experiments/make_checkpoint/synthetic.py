"""`make-checkpoint --synthetic NAME`: a LoRA + AdamW checkpoint on a random model of a real architecture.

The base model is written once to `OUT/synthetic_base/` (`models/synthetic.py`: published config numbers,
random weights, bf16 safetensors, a tokenizer of the real vocabulary size); the adapter is then trained
a few real Dr-GRPO steps by `make_checkpoint.trained.make_checkpoint`, whose checkpoint records that directory as its
base, so `entropy-probe run --set checkpoint.checkpoint_path=OUT` needs nothing else.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..config import ProbeConfig, config_from_dict
from ..models.synthetic import build_synthetic_model_dir, spec_named

log = logging.getLogger("entropy_experiments.training")

SYNTHETIC_BASE_DIR = "synthetic_base"
# A random model never writes a GSM answer: the default tag_pref reward would give every response 0, zero
# advantages and a zero adapter step. math_density (share of digits and operators) varies between responses.
SYNTHETIC_REWARD = "math_density"


def synthetic_base_dir(out_dir: str | Path, name: str, *, seed: int = 0,
                       logger: logging.Logger = log) -> Path:
    """`OUT/synthetic_base/` holding the random `name` model (built unless it is already there)."""
    spec = spec_named(name)
    base = Path(out_dir) / SYNTHETIC_BASE_DIR
    if not (base / "config.json").is_file() or not any(base.glob("*.safetensors")):
        logger.info("building %s (random weights, architecture of %s) in %s", spec.name, spec.source, base)
        build_synthetic_model_dir(spec, base, seed=seed)
    else:
        logger.info("reusing the synthetic base model in %s", base)
    return base


def with_synthetic_base(config: ProbeConfig, base_dir: Path, logger: logging.Logger = log) -> ProbeConfig:
    """`config` with checkpoint.base_model = `base_dir`; the default tag_pref reward becomes math_density (logged)."""
    d = config.to_dict()
    if d["checkpoint"]["base_model"] is not None:
        logger.warning("make-checkpoint --synthetic: checkpoint.base_model %r is replaced by the synthetic base %s",
                       d["checkpoint"]["base_model"], base_dir)
    d["checkpoint"]["base_model"] = str(base_dir.resolve())
    if d["reward"]["name"] == "tag_pref":
        logger.warning("make-checkpoint --synthetic: reward.name tag_pref gives a random model reward 0 everywhere "
                       "(a zero step); using %s instead (set reward.name to choose)", SYNTHETIC_REWARD)
        d["reward"]["name"] = SYNTHETIC_REWARD
    return config_from_dict(d)
