"""A run's statistics as lm-eval records them: per-request entries, the ranks' statistics summed into one run,
and the `spot` block of the results (`get_model_info`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_spot.decoding.types import DecodeResult
from lm_eval_spot.likelihood.harness import LikelihoodStats
from lm_eval_spot.reports.run_stats import PairedStats, RunStats, SampleStats


def sample_entry(context: str, r: DecodeResult, unknown: int) -> dict[str, Any]:
    """One request's statistics, keyed as lm-eval keys its samples file (`prompt_hash` = hash of the context)."""
    from lm_eval.utils import hash_string

    return {"prompt_hash": hash_string(context), "nfe": r.nfe.total, "gen_tokens": len(r.token_ids),
            "rounds": r.rounds, "latency_s": round(r.wall_s, 6), "stop_reason": r.stop_reason,
            "unknown_ids": unknown}


def sample_stats(r: DecodeResult, unknown: int) -> SampleStats:
    acc = sum(r.accepted) / len(r.accepted) if r.accepted else 0.0
    return SampleStats(r.nfe.total, len(r.token_ids), r.committed, r.rounds, acc, r.wall_s, r.stop_reason,
                       r.host_bytes, r.timing.forward, r.timing.draft, r.timing.rest, r.lookahead.rows,
                       r.lookahead.exact, r.lookahead.used, r.lookahead.later_blocks, unknown)


@dataclass(frozen=True)
class RankPart:
    """What one rank contributes: its statistics, per-request entries, cache hits and adaptation summary."""

    stats: RunStats
    paired: PairedStats | None
    samples: list[dict[str, Any]]
    served: int | None  # answers --use_cache returned (None: no cache; -1: unknown)
    likelihood: LikelihoodStats
    likelihood_samples: list[dict[str, Any]]
    adapt: dict[str, Any] | None


def merge_ranks(parts: list[RankPart]) -> RankPart:
    """Every rank's part as one run's (adapt: left to the caller, which knows how ranks' adaptations combine)."""
    first = parts[0].stats
    stats = RunStats(mode=first.mode, budget=first.budget, exact_prefix_cache=first.exact_prefix_cache,
                     batch_size=first.batch_size)
    paired = PairedStats() if parts[0].paired is not None else None
    # The ranks decode side by side: the run took as long as its slowest rank.
    stats.add_call(max(p.stats.call_wall_s for p in parts), max(p.stats.decode_wall_s for p in parts))
    likelihood, lik_samples, samples = LikelihoodStats(), [], []
    for p in parts:
        stats.add_steps(p.stats.steps, p.stats.forwards)
        likelihood.merge(p.likelihood)
        lik_samples.extend(p.likelihood_samples)
        for s, t, (top_k, top_p) in zip(p.stats.samples, p.stats.temperatures, p.stats.truncations, strict=True):
            stats.add(s, t, top_k, top_p)
        if paired is not None and p.paired is not None:
            paired.extend(p.paired)
        samples.extend(p.samples)
    served = [p.served for p in parts]
    known = None if any(s is None for s in served) else -1 if any(s < 0 for s in served) else sum(served)
    return RankPart(stats, paired, samples, known, likelihood, lik_samples, None)


def run_summary(run: RankPart, target: dict[str, Any], world_size: int, drafter: Path | None, reads_drafter: bool,
                drafter_note: str | None, adapt: dict[str, Any] | None,
                likelihood_settings: dict[str, Any]) -> dict[str, Any]:
    """The results' `spot` block: the run summary, paired control's, the target, the drafter, the adaptation."""
    summary = run.stats.summary()
    if run.served is not None:
        # Answers lm-eval returned from --use_cache: never decoded, so not in NFE, tokens or time (-1: unknown).
        summary["served_from_cache"] = run.served
    if run.paired is not None:
        summary.update(run.paired.summary())
    summary.update({"family": target["family"], "impl": target["impl"], "world_size": world_size})
    if reads_drafter:  # the modes that read a drafter (the fallback shows as none)
        summary["drafter"] = drafter.name if drafter is not None else None
    if drafter_note:
        summary["drafter_note"] = drafter_note
    if adapt:
        summary["adapt"] = adapt
    if run.likelihood.requests:
        summary["likelihood"] = {**run.likelihood.summary(), "settings": likelihood_settings}
    return summary
