"""Adaptive speculation: pick each request's k (0 = off) to maximize tokens per second.

Speculation pays when the tokens a verify step emits outweigh what it costs over a plain decode
step. With per-token acceptance rate alpha (drafts accepted i.i.d., the usual model), a chain of k
drafts emits ``E(k) = (1 - alpha^(k+1)) / (1 - alpha)`` tokens per step, and the step costs
``T(B, N)`` for a batch of B sequences feeding N query tokens in all (N = B for plain decode). The
controller maximizes ``sum_r E_r(k_r) / T(B, B + sum_r k_r)`` over the k_r and speculates when the
predicted speedup over ``B / T(B, B)`` clears a threshold.

What it measures, all on the host and cheap (plain Python and numpy):
- acceptance, per proposer and per request: exponential moving averages of accepted tokens and of
  acceptance trials (a step with k drafts and a accepted is a successes and, if a < k, one failure:
  the maximum-likelihood estimate of alpha under the truncated geometric model);
- acceptance conditioned on the request's previous outcome (whether its last draft had its first
  token accepted): acceptance comes in bursts -- a request quoting its prompt keeps being drafted
  right, then writes words of its own and is not -- so the state "last draft hit" predicts the next
  draft far better than any average (n-gram drafts of SmolLM2 on grounded prompts: first token
  right 88% of the time after a hit, 36% after a miss; chat 71% / 23%). Once both states have a few
  observations, a request's alpha is that of its state, so the decision follows each request's
  bursts step by step;
- step cost: an EMA of measured whole-step time per (batch-size bucket, greedy or sampled
  verification, query-token count), interpolated piecewise-linearly in the token count (so the flat
  memory-bound region and the compute-bound slope both show), plus each proposer's own drafting time
  per batch bucket. Plain steps are the baseline of both kinds; verify steps that sample
  (rejection sampling, ~2x the host work of greedy verification at batch 1) are kept apart.

Observations may also come from shadow drafts: a proposer that drafts on the host for free
(n-gram lookup) can draft from a request's history while it decodes plainly and score the draft
against the tokens that then come, which is what verification would have accepted (for greedy
decoding exactly; when sampling, a one-hot draft token is accepted with the probability that the
sampled token equals it). The decoder does that at small batches (``SpecDecoder``), so requests
are watched without probes.

Hysteresis keeps it from flapping: off -> on needs a predicted speedup >= ``on_threshold``; on -> off
happens below ``off_threshold``. While off, it speculates now and then to refresh the acceptance
estimate, so it can come back when the text becomes predictable: ``probe_steps`` steps with
``probe_k`` for the whole batch at least ``probe_interval`` steps apart, and one step for requests
never seen speculating. Both are paid from one credit that each plain step while off raises by
``probe_budget`` (divided by a backoff that doubles, up to ``max_probe_backoff``, after each
batch-wide probe that finds no gain) and each probe step lowers by its measured extra cost over a
plain step -- so probes cost at most ~``probe_budget`` of the plain decoding time however many
requests arrive, and less while they keep finding nothing. While off, a decision is not recomputed
when no acceptance observation came since the last one. While on, a step of plain decode every
``probe_interval`` steps keeps the baseline cost fresh, and requests left at k = 0 get a probe as
well.

Calibration against the outcome: the i.i.d. acceptance model is optimistic for drafts whose
acceptance comes in bursts. So the controller also measures what speculation delivered: the whole step's wall time
(drafting, scheduling, forward, verification, output) and tokens emitted, against the same for
plain decode steps of the batch bucket. Over steps that speculate (on, or probing), an EMA of
realized / predicted speedup scales
every prediction at that batch bucket (``calibration``), so a cost model that promises a gain speculation does not
deliver is corrected within a few steps and turns speculation off; the correction also raises
the bar for turning it back on.

The engine calls, per step: ``choose`` before proposing, ``observe_propose`` / ``observe_step`` with
wall times of decode-or-verify-only steps (a step carrying prefill chunks says nothing about
verify cost and should not be reported), ``observe_acceptance`` per request after verification
(or shadow drafts), and ``observe_outcome`` with the whole step's wall time and emitted tokens
(decode-only steps). The engine reports whole steps (drafting to processed outputs) to both: a
plain step overlapped with the GPU (async scheduling) then lasts about its period, a speculative
step its forward plus the host work nothing overlaps. (Until 2026-11-24 ``observe_step`` got the
forward + verification part only, which for an overlapped plain step is its launch: the cost model
saw verification several times dearer than it is, and at batch 1 the controller stayed off where
fixed chains gained 1.27x -- docs/BENCHMARKS.md, run 19. Whole-step times had been tried in run 15
with greedy and sampled verification in one cell, which priced greedy probes at sampled cost.)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens emitted per verify step of a k-draft chain with i.i.d. acceptance alpha (bonus included)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of :class:`SpecController`.

    k_max:            largest k per request.
    ema:              weight of a new observation in every moving average.
    on_threshold:     predicted speedup needed to turn speculation on.
    off_threshold:    predicted speedup under which it turns off (< on_threshold: hysteresis).
    probe_interval:   steps between probes (speculation while off, plain decode while on); while
                      off, stretched so that probes cost at most probe_budget of the decode time.
    probe_steps:      speculative steps per probe while off.
    probe_budget:     largest share of plain-decoding time that probing may add while off. Every
                      probe (batch-wide, or a new request's own) is paid from one credit: each
                      plain step while off adds probe_budget / backoff plain-step times, a probe
                      step spends its measured extra cost over a plain step.
    max_probe_backoff: while batch-wide probes keep finding that speculation does not pay, the
                      credit's rate is halved after each one, down to 1 / max_probe_backoff of
                      probe_budget (back to full rate when speculation turns on).
    off_eval_interval: while off, the decision is re-evaluated every this many steps (its numpy
                      work would otherwise weigh on fast, CUDA-graph decode steps); at small
                      batches more often: every max(1, B // 4) steps if that is fewer (every step
                      below 8 sequences, where the host has time to spare beside a plain step and
                      each request's bursts matter).
    cond_ema:         weight of one observation in the outcome-conditioned acceptances. They pool
                      every request's drafts (several per step) and describe the kind of text, so
                      they move slower than ``ema``, or a short run of misses in a batch would
                      swing them.
    cond_min_observations: observations each outcome-conditioned acceptance needs before requests
                      use it (before, a request's own average).
    probe_k:          k used while probing.
    min_calibration:  floor of the realized / predicted speedup scale (keeps probes able to turn
                      speculation back on when acceptance improves a lot).
    max_calibration:  its ceiling (a cost model too pessimistic is corrected up to this factor).
    calibration_ema:  weight of one step in the calibration (slower than ``ema``: one step's
                      realized speedup is noisy, and a noisy scale would flap decisions inside the
                      hysteresis band; a loss is still cut within ~20 steps).
    prior_alpha:      acceptance assumed before any observation.
    prior_token_cost: cost of one extra query token per sequence, relative to a decode step, used
                      until two token counts of a batch bucket have been measured.
    """

    k_max: int = 5
    ema: float = 0.1
    on_threshold: float = 1.10
    off_threshold: float = 1.02
    probe_interval: int = 64
    probe_steps: int = 4
    probe_budget: float = 0.025
    max_probe_backoff: int = 4
    off_eval_interval: int = 16
    cond_ema: float = 0.02
    cond_min_observations: int = 20
    probe_k: int = 2
    prior_alpha: float = 0.5
    prior_token_cost: float = 0.05
    min_calibration: float = 0.25
    max_calibration: float = 2.0
    calibration_ema: float = 0.05

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"AdaptiveConfig.k_max must be >= 1, got {self.k_max}")
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"AdaptiveConfig.ema must be in (0, 1], got {self.ema}")
        if not 0.0 < self.cond_ema <= 1.0:
            raise ValueError(f"AdaptiveConfig.cond_ema must be in (0, 1], got {self.cond_ema}")
        if self.cond_min_observations < 0:
            raise ValueError(f"AdaptiveConfig.cond_min_observations must be >= 0, got {self.cond_min_observations}")
        if self.off_threshold > self.on_threshold:
            raise ValueError(
                f"AdaptiveConfig.off_threshold ({self.off_threshold}) must be <= on_threshold ({self.on_threshold})"
            )
        if self.probe_interval < 1 or self.probe_steps < 1:
            raise ValueError("AdaptiveConfig.probe_interval and probe_steps must be >= 1")
        if self.off_eval_interval < 1:
            raise ValueError(f"AdaptiveConfig.off_eval_interval must be >= 1, got {self.off_eval_interval}")
        if not 0.0 < self.probe_budget <= 1.0:
            raise ValueError(f"AdaptiveConfig.probe_budget must be in (0, 1], got {self.probe_budget}")
        if self.max_probe_backoff < 1:
            raise ValueError(f"AdaptiveConfig.max_probe_backoff must be >= 1, got {self.max_probe_backoff}")
        if not 1 <= self.probe_k <= self.k_max:
            raise ValueError(f"AdaptiveConfig.probe_k must be in [1, k_max={self.k_max}], got {self.probe_k}")
        if not 0.0 <= self.prior_alpha < 1.0:
            raise ValueError(f"AdaptiveConfig.prior_alpha must be in [0, 1), got {self.prior_alpha}")
        if not 0.0 < self.calibration_ema <= 1.0:
            raise ValueError(f"AdaptiveConfig.calibration_ema must be in (0, 1], got {self.calibration_ema}")
        if not 0.0 < self.min_calibration <= 1.0 <= self.max_calibration:
            raise ValueError(
                f"AdaptiveConfig needs 0 < min_calibration <= 1 <= max_calibration, got "
                f"{self.min_calibration} and {self.max_calibration}"
            )
        if self.prior_token_cost < 0:
            raise ValueError(f"AdaptiveConfig.prior_token_cost must be >= 0, got {self.prior_token_cost}")


class AcceptanceEMA:
    """Per-token acceptance rate from (proposed, accepted) observations, smoothed by an EMA.

    Starts from a prior worth one trial, so the first observations move it quickly. warmup: the
    n-th observation weighs max(ema, 1 / (n + 1)) -- a plain average until there are 1 / ema of
    them -- for a small ema, which would otherwise stay near the prior for long.
    """

    def __init__(self, ema: float, prior_alpha: float, warmup: bool = False) -> None:
        self.ema = ema
        self.warmup = warmup
        self.successes = prior_alpha
        self.trials = 1.0
        self.accepted_per_step = 0.0
        self.num_observations = 0

    def observe(self, num_proposed: int, num_accepted: int) -> None:
        """num_proposed: positions that could be accepted (chain length, or tree depth)."""
        if num_proposed <= 0:
            return
        a = min(num_accepted, num_proposed)
        w = max(self.ema, 1.0 / (self.num_observations + 2)) if self.warmup else self.ema
        self.successes = (1 - w) * self.successes + w * a
        self.trials = (1 - w) * self.trials + w * (a + (1 if a < num_proposed else 0))
        self.accepted_per_step = (1 - w) * self.accepted_per_step + w * a if self.num_observations else float(a)
        self.num_observations += 1

    @property
    def alpha(self) -> float:
        # Capped below 1 so that E(k) stays finite-sloped and k_max still binds.
        return min(self.successes / max(self.trials, 1e-9), 0.999)


def _ema(d: dict, key, value: float, w: float) -> None:
    """d[key] <- EMA of value with weight w (value itself the first time)."""
    old = d.get(key)
    d[key] = value if old is None else (1 - w) * old + w * value


def _bucket(num_seqs: int) -> int:
    """Batch-size bucket: the next power of two (1, 2, 4, ...)."""
    return 1 << max(0, (num_seqs - 1).bit_length())


class StepCostModel:
    """Measured step time as a function of (batch size, query tokens).

    Per batch bucket, an EMA of seconds per exact query-token count; predictions interpolate
    piecewise-linearly between measured counts and extrapolate along the nearest segment. With a
    single measured count the slope comes from ``prior_token_cost``.
    """

    def __init__(self, ema: float = 0.1, prior_token_cost: float = 0.05, max_cells: int = 64) -> None:
        self.ema = ema
        self.prior_token_cost = prior_token_cost
        self.max_cells = max_cells
        self._cells: dict[tuple[int, bool], dict[int, float]] = {}  # (bucket, sampled) -> {num_tokens: seconds}
        self._has_decode: set[int] = set()

    def observe(self, num_seqs: int, num_tokens: int, seconds: float, sampled: bool = False) -> None:
        """sampled: the step verified drafts by rejection sampling (dearer than greedy verification,
        so kept apart); a plain step (num_tokens == num_seqs) is the baseline of both."""
        if num_seqs <= 0 or num_tokens < num_seqs or seconds <= 0:
            return
        b = _bucket(num_seqs)
        for key in ((b, False), (b, True)) if num_tokens == num_seqs else ((b, sampled),):
            cells = self._cells.setdefault(key, {})
            old = cells.pop(num_tokens, None)  # re-insert: dict order is recency order, for eviction
            cells[num_tokens] = seconds if old is None else (1 - self.ema) * old + self.ema * seconds
            if len(cells) > self.max_cells:
                del cells[next(iter(cells))]
        if num_tokens == num_seqs:
            self._has_decode.add(b)

    def has_baseline(self, num_seqs: int) -> bool:
        """Whether a plain decode step of this batch bucket has been measured."""
        return _bucket(num_seqs) in self._has_decode

    def predict(self, num_seqs: int, num_tokens: np.ndarray | int, sampled: bool = False) -> np.ndarray | float | None:
        """Predicted seconds for num_tokens (scalar or array); None before any measurement."""
        cells = self._cells.get((_bucket(num_seqs), sampled))
        if not cells:
            return None
        if np.ndim(num_tokens) == 0:
            return self._predict_small(cells, num_seqs, [float(num_tokens)])[0]
        if len(num_tokens) <= 48:  # numpy's fixed costs exceed the work (batch-1 steps decide each step)
            return np.array(self._predict_small(cells, num_seqs, [float(n) for n in num_tokens]))
        return self._predict_numpy(cells, num_seqs, num_tokens)

    def _predict_numpy(self, cells: dict[int, float], num_seqs: int, num_tokens: np.ndarray) -> np.ndarray:
        xs = np.array(sorted(cells), dtype=np.float64)
        ys = np.array([cells[int(x)] for x in xs])
        n = np.asarray(num_tokens, dtype=np.float64)
        if len(xs) == 1:
            # Decode-equivalent time from the one point, then the prior slope per token per sequence.
            base = ys[0] / (1 + self.prior_token_cost * (xs[0] - num_seqs) / num_seqs)
            out = base * (1 + self.prior_token_cost * (n - num_seqs) / num_seqs)
        else:
            out = np.interp(n, xs, ys)
            lo_slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
            hi_slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
            out = np.where(n < xs[0], ys[0] - lo_slope * (xs[0] - n), out)
            out = np.where(n > xs[-1], ys[-1] + hi_slope * (n - xs[-1]), out)
        return np.maximum(out, 1e-9)

    def _predict_small(self, cells: dict[int, float], num_seqs: int, ns: list[float]) -> list[float]:
        """predict() in plain Python, for a few token counts (same formulas)."""
        xs = sorted(cells)
        ys = [cells[x] for x in xs]
        out = []
        if len(xs) == 1:
            base = ys[0] / (1 + self.prior_token_cost * (xs[0] - num_seqs) / num_seqs)
            for n in ns:
                out.append(max(base * (1 + self.prior_token_cost * (n - num_seqs) / num_seqs), 1e-9))
            return out
        lo_slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
        hi_slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        for n in ns:
            if n < xs[0]:
                y = ys[0] - lo_slope * (xs[0] - n)
            elif n > xs[-1]:
                y = ys[-1] + hi_slope * (n - xs[-1])
            else:
                i = max(1, bisect.bisect_left(xs, n))
                x0, x1 = xs[i - 1], xs[i]
                y = ys[i] if n == x1 else ys[i - 1] + (ys[i] - ys[i - 1]) * (n - x0) / (x1 - x0)
            out.append(max(y, 1e-9))
        return out

    def ratio(self, num_seqs: int, k: int, sampled: bool = False) -> float:
        """T(B, B (k + 1)) / T(B, B): the cost of a verify step with k drafts per sequence."""
        t = self.predict(num_seqs, [num_seqs, num_seqs * (k + 1)], sampled)
        if t is None:
            return 1.0 + self.prior_token_cost * k
        return float(t[1] / t[0])


@dataclass
class _ProposerState:
    acceptance: AcceptanceEMA
    requests: dict[str, AcceptanceEMA] = field(default_factory=dict)
    idle: dict[str, int] = field(default_factory=dict)  # steps since a request last speculated
    probed: set = field(default_factory=set)  # requests given their first probe while off
    # acceptance conditioned on the previous outcome (True: the request's last draft had its first
    # token accepted), and each request's last outcome
    cond: dict[bool, AcceptanceEMA] = field(default_factory=dict)
    last_hit: dict[str, bool] = field(default_factory=dict)
    on: bool = False
    steps_in_mode: int = 0
    probing: int = 0  # speculative probe steps left
    # what probes may still spend, in plain-step times (SpecController starts it at one batch-wide
    # probe's worth at an extra cost of one plain step), and the divisor of its rate
    credit: float = 0.0
    backoff: int = 1
    probe_ended: bool = False  # a batch-wide probe's last step was chosen; its verdict is pending
    # acceptance observations at the last decision that stayed off, and decisions skipped since
    # because none came
    eval_obs: int = -1
    evals_skipped: int = 0
    propose_cost: dict[int, float] = field(default_factory=dict)  # bucket -> seconds per step
    last_speedup: float = 0.0  # predicted (uncalibrated) speedup of the last allocation
    last_mode: str = "off"  # what the last choose() did: "off", "on" or "probe"
    # bucket -> [EMA of realized speedup, EMA of predicted speedup] over steps that speculated (on
    # or probing); their ratio, clamped, is the calibration (less biased by noise than an EMA of ratios)
    cal_sums: dict[int, list[float]] = field(default_factory=dict)
    spec_step_s: dict[tuple[int, bool], float] = field(default_factory=dict)  # (bucket, sampled) -> whole speculating step, EMA


class SpecController:
    """Chooses k per request per step, per proposer, from measured acceptance and step costs."""

    def __init__(self, config: Optional[AdaptiveConfig] = None) -> None:
        self.config = config or AdaptiveConfig()
        self.costs = StepCostModel(self.config.ema, self.config.prior_token_cost)
        self._states: dict[str, _ProposerState] = {}
        self._plain_rate: dict[int, float] = {}  # bucket -> tokens/s of whole plain decode steps
        self._plain_step_s: dict[int, float] = {}  # bucket -> seconds of a whole plain decode step
        self._extra_cache: dict[tuple, tuple[float, int]] = {}  # see _probe_extra_cached

    def _state(self, proposer: str) -> _ProposerState:
        st = self._states.get(proposer)
        if st is None:
            c = self.config
            st = _ProposerState(AcceptanceEMA(c.ema, c.prior_alpha), credit=float(c.probe_steps))
            st.cond = {hit: AcceptanceEMA(c.cond_ema, c.prior_alpha, warmup=True) for hit in (False, True)}
            self._states[proposer] = st
        return st

    # -- observations ---------------------------------------------------------------------------

    def observe_step(self, num_seqs: int, num_tokens: int, seconds: float, sampled: bool = False) -> None:
        """Wall time of a decode or verify step; sampled: drafts verified by rejection sampling."""
        self.costs.observe(num_seqs, num_tokens, seconds, sampled)

    def observe_outcome(self, proposer: str, num_seqs: int, num_emitted: int, seconds: float, speculated: bool,
                        sampled: bool = False) -> None:
        """A whole decode-only step: wall time from drafting to processed outputs, tokens emitted.
        Plain steps set the bucket's baseline rate; steps that speculated (on or probing) update the
        proposer's calibration (realized / predicted speedup)."""
        if num_seqs <= 0 or seconds <= 0:
            return
        b = _bucket(num_seqs)
        w = self.config.ema
        rate = num_emitted / seconds
        if not speculated:
            if num_emitted == 0:  # e.g. the first of overlapped steps, whose tokens come a step later
                return
            _ema(self._plain_rate, b, rate, w)
            _ema(self._plain_step_s, b, seconds, w)
            return
        st = self._state(proposer)
        _ema(st.spec_step_s, (b, sampled), seconds, w)
        base = self._plain_rate.get(b)
        if not base or st.last_mode == "off" or st.last_speedup <= 0:
            return
        w = self.config.calibration_ema
        sums = st.cal_sums.setdefault(b, [1.0, 1.0])  # a prior of one trusted step
        sums[0] = (1 - w) * sums[0] + w * (rate / base)
        sums[1] = (1 - w) * sums[1] + w * st.last_speedup

    def calibration(self, proposer: str, num_seqs: int) -> float:
        """Realized / predicted speedup at this batch bucket, clamped (1 before any observation)."""
        sums = self._state(proposer).cal_sums.get(_bucket(num_seqs))
        if sums is None:
            return 1.0
        return min(self.config.max_calibration, max(self.config.min_calibration, sums[0] / sums[1]))

    def observe_propose(self, proposer: str, num_seqs: int, seconds: float) -> None:
        """Wall time the proposer spent drafting for a batch of num_seqs (draft models cost real time)."""
        _ema(self._state(proposer).propose_cost, _bucket(num_seqs), seconds, self.config.ema)

    def observe_acceptance(self, proposer: str, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """After verification (or a shadow draft's scoring): the request had num_proposed draft
        positions and num_accepted were kept."""
        if num_proposed <= 0:
            return
        st = self._state(proposer)
        st.acceptance.observe(num_proposed, num_accepted)
        prev = st.last_hit.get(request_id)
        if prev is not None:
            st.cond[prev].observe(num_proposed, num_accepted)
        st.last_hit[request_id] = num_accepted >= 1
        req = st.requests.get(request_id)
        if req is None:
            # A new request starts from what the proposer does on average.
            req = st.requests[request_id] = AcceptanceEMA(self.config.ema, st.acceptance.alpha)
        req.observe(num_proposed, num_accepted)

    def remove_request(self, request_id: str) -> None:
        for st in self._states.values():
            st.requests.pop(request_id, None)
            st.idle.pop(request_id, None)
            st.probed.discard(request_id)
            st.last_hit.pop(request_id, None)

    # -- decisions ------------------------------------------------------------------------------

    def alpha(self, proposer: str, request_id: Optional[str] = None) -> float:
        """The acceptance a request's next draft is expected to have: that of its state (last draft
        hit or missed) once both states are measured, else its own average, else the proposer's."""
        st = self._state(proposer)
        if request_id is None:
            return st.acceptance.alpha
        hit = st.last_hit.get(request_id)
        if hit is not None and min(e.num_observations for e in st.cond.values()) >= self.config.cond_min_observations:
            return st.cond[hit].alpha
        req = st.requests.get(request_id)
        return (req or st.acceptance).alpha

    def is_on(self, proposer: str) -> bool:
        return self._state(proposer).on

    def allocate(
        self, proposer: str, alphas: Sequence[float], max_k: Optional[Sequence[int]] = None, sampled: bool = False
    ) -> tuple[list[int], float]:
        """The k per request maximizing predicted tokens per second, and its speedup over decode.

        The gain of request r's j-th draft is alpha_r^j (decreasing in j), so adding drafts in
        decreasing order of gain gives the best allocation for every total; the total is then
        chosen by evaluating the cost model at each one.
        """
        cfg = self.config
        bsz = len(alphas)
        if bsz == 0:
            return [], 1.0
        caps = [cfg.k_max] * bsz if max_k is None else [max(0, min(cfg.k_max, m)) for m in max_k]
        if bsz * cfg.k_max <= 48:
            return self._allocate_small(proposer, alphas, caps, sampled)
        return self._allocate_numpy(proposer, alphas, caps, sampled)

    def _allocate_numpy(self, proposer: str, alphas: Sequence[float], caps: list[int],
                        sampled: bool) -> tuple[list[int], float]:
        cfg = self.config
        bsz = len(alphas)
        a = np.asarray(alphas, dtype=np.float64)[:, None]
        j = np.arange(1, cfg.k_max + 1, dtype=np.float64)[None, :]
        gains = a**j  # [B, k_max]
        gains[j.astype(int).repeat(bsz, 0) > np.asarray(caps)[:, None]] = -1.0
        flat = gains.ravel()
        order = np.argsort(-flat, kind="stable")
        order = order[flat[order] > 0]
        tokens = bsz + np.concatenate([[0.0], np.cumsum(flat[order])])  # [n + 1]
        counts = bsz + np.arange(len(order) + 1)
        cost = self.costs.predict(bsz, counts, sampled)
        if cost is None:
            cost = 1.0 + cfg.prior_token_cost * (counts - bsz) / bsz
        cost = cost + np.where(counts > bsz, self._state(proposer).propose_cost.get(_bucket(bsz), 0.0), 0.0)
        tput = tokens / cost
        best = int(np.argmax(tput))
        ks = np.bincount(order[:best] // cfg.k_max, minlength=bsz)
        return [int(k) for k in ks], float(tput[best] / tput[0])

    def _allocate_small(self, proposer: str, alphas: Sequence[float], caps: list[int],
                        sampled: bool) -> tuple[list[int], float]:
        """allocate() in plain Python, for a few requests (same order of drafts, same choice)."""
        cfg = self.config
        bsz = len(alphas)
        flat = [(float(a) ** j if j <= c else -1.0) for a, c in zip(alphas, caps) for j in range(1, cfg.k_max + 1)]
        order = [i for i in sorted(range(len(flat)), key=lambda i: -flat[i]) if flat[i] > 0]
        tokens = [float(bsz)]
        for i in order:
            tokens.append(tokens[-1] + flat[i])
        counts = [bsz + i for i in range(len(order) + 1)]
        cost = self.costs.predict(bsz, counts, sampled)
        if cost is None:
            cost = [1.0 + cfg.prior_token_cost * (n - bsz) / bsz for n in counts]
        pc = self._state(proposer).propose_cost.get(_bucket(bsz), 0.0)
        tput = [t / (c + (pc if n > bsz else 0.0)) for t, c, n in zip(tokens, cost, counts)]
        best = max(range(len(tput)), key=tput.__getitem__)
        ks = [0] * bsz
        for i in order[:best]:
            ks[i // cfg.k_max] += 1
        return ks, tput[best] / tput[0]

    def predicted_speedup(self, proposer: str, alphas: Sequence[float], ks: Sequence[int], sampled: bool = False) -> float:
        """The cost model's speedup over plain decode of a given allocation (probes' k)."""
        bsz = len(ks)
        if bsz == 0:
            return 1.0
        tokens = sum(expected_tokens(a, k) for a, k in zip(alphas, ks))
        n = bsz + sum(ks)
        cost = self.costs.predict(bsz, [bsz, n], sampled)
        if cost is None:
            base, t = 1.0, 1.0 + self.config.prior_token_cost * (n - bsz) / bsz
        else:
            base, t = float(cost[0]), float(cost[1])
        if n > bsz:
            t += self._state(proposer).propose_cost.get(_bucket(bsz), 0.0)
        return (tokens / t) / (bsz / base)

    def probe_extra(self, proposer: str, num_seqs: int, sampled: bool = False) -> float:
        """What one probe step costs over a plain step, in plain-step times: the cost model's (verify
        + drafting) or, when larger, the measured one of whole steps that speculated against whole
        plain steps (which sees what the model does not, e.g. a plain step overlapped with the GPU's
        work against a speculative step that cannot be). At least 0.05."""
        cfg = self.config
        st = self._state(proposer)
        b = _bucket(num_seqs)
        extra = self.costs.ratio(num_seqs, cfg.probe_k, sampled) - 1.0
        base = self.costs.predict(num_seqs, num_seqs)
        if base is not None:
            extra += st.propose_cost.get(b, 0.0) / base
        if (b, sampled) in st.spec_step_s and self._plain_step_s.get(b):
            extra = max(extra, st.spec_step_s[(b, sampled)] / self._plain_step_s[b] - 1.0)
        return max(extra, 0.05)

    def _probe_extra_cached(self, proposer: str, num_seqs: int, sampled: bool) -> float:
        """probe_extra, recomputed every 16th call per (proposer, bucket, sampled): while off it is
        asked at every decision that could probe, and the costs it reads move slowly."""
        key = (proposer, _bucket(num_seqs), sampled)
        hit = self._extra_cache.get(key)
        if hit is not None and hit[1] > 0:
            self._extra_cache[key] = (hit[0], hit[1] - 1)
            return hit[0]
        extra = self.probe_extra(proposer, num_seqs, sampled)
        self._extra_cache[key] = (extra, 15)
        return extra

    def probe_interval(self, proposer: str, num_seqs: int, sampled: bool = False) -> int:
        """Steps between batch-wide probes while off, when nothing else spends the probe credit:
        probe_interval, or more when probe_steps probe steps would cost more than the credit that
        many plain steps earn (probe_budget / backoff of their time)."""
        cfg = self.config
        st = self._state(proposer)
        need = cfg.probe_steps * self.probe_extra(proposer, num_seqs, sampled) * st.backoff / cfg.probe_budget
        return max(cfg.probe_interval, int(np.ceil(need)))

    def skip_step(self, proposer: str, num_seqs: int) -> bool:
        """The cheap part of :meth:`choose`, which it runs first: True when this step goes without
        drafts whatever the requests (no plain-decode baseline at this batch size yet, or off between
        evaluations), so that the caller can skip building its per-request inputs. Counts the step;
        a False answer must be followed by ``choose(..., prechecked=True)``."""
        st = self._state(proposer)
        if not self.costs.has_baseline(num_seqs):
            return True  # measure plain decode at this batch size first: every decision needs it
        st.steps_in_mode += 1
        if st.on or st.probing:
            return False
        st.credit += self.config.probe_budget / st.backoff  # a plain step while off earns probe credit
        # off: decide again every few steps only, so plain steps stay cheap
        return st.steps_in_mode % self.eval_interval(num_seqs) != 0

    def eval_interval(self, num_seqs: int) -> int:
        """Steps between decisions while off: off_eval_interval, every step at small batches."""
        return min(self.config.off_eval_interval, max(1, num_seqs // 4))

    def choose(
        self, request_ids: Sequence[str], proposer: str = "default", max_k: Optional[Sequence[int]] = None,
        prechecked: bool = False, sampled: bool = False,
    ) -> list[int]:
        """k for each request this step (0 = no drafts). max_k optionally caps each request
        (remaining max_tokens, room left in the context window). prechecked: skip_step was called
        for this step and said False."""
        cfg = self.config
        st = self._state(proposer)
        bsz = len(request_ids)
        if bsz == 0:
            return []
        zeros = [0] * bsz
        if not prechecked and self.skip_step(proposer, bsz):
            return zeros
        caps = [cfg.k_max] * bsz if max_k is None else [max(0, min(cfg.k_max, m)) for m in max_k]
        for r in request_ids:
            st.idle[r] = st.idle.get(r, 0) + 1
        if (not st.on and not st.probing and st.acceptance.num_observations == st.eval_obs
                and st.evals_skipped < 8):
            # Off, and no acceptance observation since the last decision: the verdict stays (only
            # the batch's make-up and the plain-step costs can have moved; re-done every 9th time).
            # The per-request estimates and the allocation are skipped; probes are still decided.
            st.evals_skipped += 1
            alphas = None
            ks, speedup = list(zeros), 0.0
        else:
            st.evals_skipped = 0
            alphas = [self.alpha(proposer, r) for r in request_ids]
            ks, speedup = self.allocate(proposer, alphas, caps, sampled)
            st.last_speedup = speedup
            speedup *= self.calibration(proposer, bsz)  # delivered so far against predicted
        st.last_mode = "probe" if st.probing > 0 else "on" if st.on else "off"

        if st.probing > 0:
            st.probing -= 1
            st.probe_ended = st.probing == 0
            ks = [min(cfg.probe_k, c) for c in caps]
            st.last_speedup = self.predicted_speedup(proposer, alphas, ks, sampled)
        elif st.on:
            if speedup < cfg.off_threshold:
                st.on, st.steps_in_mode, st.last_mode = False, 0, "off"
                return zeros
            if st.steps_in_mode % cfg.probe_interval == 0:
                st.last_mode = "off"
                return zeros  # refresh the decode baseline now and then
            for i, r in enumerate(request_ids):
                if ks[i] == 0 and caps[i] > 0 and st.idle[r] >= cfg.probe_interval:
                    ks[i] = min(cfg.probe_k, caps[i])  # give a request left out a fresh look
        else:
            if st.probe_ended and speedup < cfg.on_threshold:
                # the probe found no gain: probe less often while that lasts
                st.backoff = min(cfg.max_probe_backoff, 2 * st.backoff)
            st.probe_ended = False
            if speedup >= cfg.on_threshold:
                st.on, st.steps_in_mode, st.last_mode, st.backoff = True, 0, "on", 1
                return self._mark_busy(st, request_ids, ks)
            # A request not seen speculating yet gets one probe of its own, paid from the same
            # credit as batch-wide ones: its text may be far more predictable than the average (a
            # request that quotes its prompt), and a short request would end before the next
            # batch-wide probe. Decided again the next step.
            fresh = [i for i, r in enumerate(request_ids)
                     if caps[i] > 0 and r not in st.requests and r not in st.probed]
            batch_due = st.steps_in_mode >= cfg.probe_interval
            extra = self._probe_extra_cached(proposer, bsz, sampled) if fresh or batch_due else 0.0
            # unspent credit is capped at two batch-wide probes' worth
            st.credit = min(st.credit, 2.0 * cfg.probe_steps * max(extra, 1.0))
            if batch_due and st.credit >= cfg.probe_steps * extra:
                st.credit -= cfg.probe_steps * extra
                st.steps_in_mode = 0
                st.probing = cfg.probe_steps - 1
                st.probe_ended = st.probing == 0
                ks = [min(cfg.probe_k, c) for c in caps]
            elif fresh and st.credit >= extra:
                st.credit -= extra
                ks = list(zeros)
                for i in fresh:
                    ks[i] = min(cfg.probe_k, caps[i])
                    st.probed.add(request_ids[i])
                st.steps_in_mode -= 1  # (a multiple of the interval here) the next step evaluates again
            else:
                st.eval_obs = st.acceptance.num_observations
                return zeros
            st.last_mode = "probe"
            alphas = alphas or [self.alpha(proposer, r) for r in request_ids]
            st.last_speedup = self.predicted_speedup(proposer, alphas, ks, sampled)
        return self._mark_busy(st, request_ids, ks)

    @staticmethod
    def _mark_busy(st: _ProposerState, request_ids: Sequence[str], ks: list[int]) -> list[int]:
        """Requests given drafts are no longer idle; returns ks."""
        for r, k in zip(request_ids, ks):
            if k > 0:
                st.idle[r] = 0
        return ks

    def as_dict(self) -> dict:
        """Controller state for logs and the metrics endpoint."""
        return {
            name: {
                "on": st.on,
                "alpha": round(st.acceptance.alpha, 4),
                "accepted_per_step": round(st.acceptance.accepted_per_step, 4),
                "alpha_after_hit": round(st.cond[True].alpha, 4),
                "alpha_after_miss": round(st.cond[False].alpha, 4),
                "predicted_speedup": round(st.last_speedup, 4),
                "calibration": {b: round(self.calibration(name, b), 4) for b in sorted(st.cal_sums)},
                "probing": st.probing > 0,
                "probe_credit": round(st.credit, 4),
                "probe_backoff": st.backoff,
            }
            for name, st in self._states.items()
        }
