"""Speculative decoding counters, per proposer (what /metrics and the benchmarks report)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ProposerStats:
    """Counters of one proposer. A "step" is one request's verification in one engine step.

    num_steps:            verifications of a draft (requests that had a draft this step).
    num_no_draft:         requests the proposer was asked about but returned nothing for.
    num_draft_tokens:     draft tokens (tree nodes) sent to verification.
    num_accepted_tokens:  draft tokens accepted.
    num_emitted_tokens:   tokens emitted by those verifications (accepted + the target's own).
    accepted_hist:        accepted_hist[a] = steps that accepted exactly a drafts.
    """

    num_steps: int = 0
    num_no_draft: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_hist: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (for trees: accepted path length / nodes)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.num_accepted_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def mean_emitted_per_step(self) -> float:
        """Tokens per verify step per request: 1 means speculation bought nothing."""
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0


class SpecMetrics:
    """Accumulates :class:`ProposerStats` by proposer name."""

    def __init__(self) -> None:
        self.proposers: dict[str, ProposerStats] = {}

    def _get(self, proposer: str) -> ProposerStats:
        return self.proposers.setdefault(proposer, ProposerStats())

    def record(self, proposer: str, num_draft_tokens: int, num_accepted: int, num_emitted: int | None = None) -> None:
        """One request's verification: num_draft_tokens proposed, num_accepted kept; it emitted
        num_emitted tokens (default num_accepted + 1; less when a stop condition cut it short)."""
        if num_accepted < 0 or num_accepted > num_draft_tokens:
            raise ValueError(f"num_accepted={num_accepted} must be in [0, num_draft_tokens={num_draft_tokens}]")
        s = self._get(proposer)
        s.num_steps += 1
        s.num_draft_tokens += num_draft_tokens
        s.num_accepted_tokens += num_accepted
        s.num_emitted_tokens += num_accepted + 1 if num_emitted is None else num_emitted
        if len(s.accepted_hist) <= num_accepted:
            s.accepted_hist.extend([0] * (num_accepted + 1 - len(s.accepted_hist)))
        s.accepted_hist[num_accepted] += 1

    def record_no_draft(self, proposer: str, count: int = 1) -> None:
        self._get(proposer).num_no_draft += count

    def as_dict(self) -> dict[str, dict]:
        return {
            name: {
                "num_steps": s.num_steps,
                "num_no_draft": s.num_no_draft,
                "num_draft_tokens": s.num_draft_tokens,
                "num_accepted_tokens": s.num_accepted_tokens,
                "num_emitted_tokens": s.num_emitted_tokens,
                "acceptance_rate": s.acceptance_rate,
                "mean_accepted_per_step": s.mean_accepted_per_step,
                "mean_emitted_per_step": s.mean_emitted_per_step,
                "accepted_hist": list(s.accepted_hist),
            }
            for name, s in self.proposers.items()
        }

    def reset(self) -> None:
        self.proposers.clear()
