"""The probe's recipe and what orchestrates it (phases, typed results, run directory, resume, distributed runs).

    recipe.py      run(config) -> ProbeOutcome: load → sample → update → entropy → bars → beyond, in one file
    beyond.py      the phases after δH₁: ΔH(η), second order, competing predictors
    results.py     the typed results the phases hand each other
    sampling.py    the index plan turned into packed E and U batches
    preflight.py   data and rewards checked before the model loads
    memory_plan.py the with-grad microbatch under a memory budget
    runner.py      run_probe(config, out=..., resume=...): a probe run with its run directory
    reanalysis.py  another run's saved samples analysed with different settings
    parallel.py    torch.distributed: process group, index-plan broadcast, rank slices, reductions
    lifecycle.py   SIGTERM / SIGINT as a clean interruption
"""

from .recipe import ProbeOutcome, run
from .runner import run_probe

__all__ = ["ProbeOutcome", "run", "run_probe"]
