"""sweep.json's marks of rollout reuse (objective.num_iterations > 1: checkpoint/rollouts.py).

Each `rows` entry gets `next_step_reuses_rollouts` (its next step is off-policy: the sweep measured only Ĥ
there) and each `realised` interval `rollout_reuse_steps`: the steps inside it that reused rollouts (empty when
num_iterations = 1). Steps are counted from global_step 0 (a run trained without interruption).
"""

from __future__ import annotations

from ..checkpoint.rollouts import reuses_rollouts

__all__ = ["mark_rollout_reuse"]


def mark_rollout_reuse(rows: list[dict], realised: list[dict], num_iterations: int) -> None:
    """Add the reuse marks to sweep.json's `rows` and `realised` entries in place."""
    for row in rows:
        row["next_step_reuses_rollouts"] = reuses_rollouts(row["step"] + 1, num_iterations)
    for interval in realised:
        interval["rollout_reuse_steps"] = [step for step in range(interval["from_step"] + 1, interval["to_step"] + 1)
                                           if reuses_rollouts(step, num_iterations)]
