"""The entropy the autopilot steers on: fresh Ĥ and the paired realised changes combined (a Kalman filter, pure).

Two measurements of the policy's entropy arrive at every probed step. Ĥ on the step's fresh evaluation batch
is unbiased but noisy (SE 0.1–0.3 nats/token at 16 sequences on a small model); the realised change of the
step, measured on that same batch before and after (paired), is far sharper. The state is

    h0      the entropy at the first probed step
    drift   D, the change since then (0 at the first step, exactly)

with a 2×2 covariance P. A step adds its realised change r ± se_r to D (P_DD += se_r²); a fresh Ĥ ± SE_Ĥ
measures h0 + D and corrects both by the Kalman gain. Two gaps follow:

    target "initial"   H₀ − H = −D, var P_DD: only the paired changes' noise, never Ĥ's — holding the start
                       needs no estimate of the start
    any other target   H* − (h0 + D), var [1 1]·P·[1 1]ᵀ: every fresh Ĥ so far, pooled along the steps

Ĥ of a step and its realised change share that step's batch; the small correlation this leaves between the
measurement and the next increment is ignored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from entropy_experiments.integrations.autopilot_rule import Estimate


@dataclass(frozen=True)
class EntropyTrack:
    """h0, the drift D since the first probed step, and their covariance (P00, P01, P11)."""

    h0: float
    drift: float
    cov: tuple[float, float, float]

    @property
    def entropy(self) -> Estimate:
        """H = h0 + D with its SE."""
        p00, p01, p11 = self.cov
        return Estimate(self.h0 + self.drift, math.sqrt(max(p00 + 2 * p01 + p11, 0.0)))

    def gap_to(self, target: float | None) -> Estimate:
        """target − H; target None: the initial entropy (−D, from the paired changes alone)."""
        if target is None:
            return Estimate(-self.drift, math.sqrt(max(self.cov[2], 0.0)))
        H = self.entropy
        return Estimate(target - H.value, H.se)


def first_track(H: Estimate) -> EntropyTrack:
    """The track at the first probed step: h0 = Ĥ ± SE_Ĥ, no drift yet."""
    return EntropyTrack(H.value, 0.0, (H.se ** 2, 0.0, 0.0))


def after_step(track: EntropyTrack, realised: Estimate, steps: int = 1) -> EntropyTrack:
    """The track after `steps` optimizer steps of which the first was measured (realised ± se): the others
    (every > 1) are assumed to move like it, each with an uncertainty of its own size."""
    unmeasured = steps - 1
    extra = unmeasured * realised.value
    variance = realised.se ** 2 * steps ** 2 + extra ** 2
    p00, p01, p11 = track.cov
    return EntropyTrack(track.h0, track.drift + realised.value + extra, (p00, p01, p11 + variance))


def observe(track: EntropyTrack, H: Estimate) -> EntropyTrack:
    """The track corrected by a fresh Ĥ ± SE_Ĥ of h0 + D (one Kalman update)."""
    p00, p01, p11 = track.cov
    innovation_var = p00 + 2 * p01 + p11 + H.se ** 2
    if not innovation_var > 0:
        return track
    k0, k1 = (p00 + p01) / innovation_var, (p01 + p11) / innovation_var
    innovation = H.value - (track.h0 + track.drift)
    s0, s1 = p00 + p01, p01 + p11  # P·[1 1]ᵀ
    cov = (p00 - k0 * s0, p01 - k0 * s1, p11 - k1 * s1)
    return EntropyTrack(track.h0 + k0 * innovation, track.drift + k1 * innovation, cov)
