"""Per-sample counters and the run-level summary that lands in the results' config under `spot`.

Formulas (docs/definitions.md): NFE = target forwards (a batched verification forward is one; prefill and block stores
count too); tokens per forward = committed tokens / NFE; throughput = generated tokens / wall seconds, prompt
tokens never counted.

Time: the run's `wall_s` is the time the user waited for lm-eval's generate calls (summed over calls, never over
requests: at batch size N the requests' latencies overlap); `gen_tokens_per_s` divides by the time of the
method's own decoding calls (the same thing unless control=paired also decodes every request draft-free). Each
request's latency (start to finish, batch-mates running alongside) stays per sample as `latency_s`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import mean, median
from typing import Any


@dataclass(frozen=True)
class SampleStats:
    nfe: int
    gen_tokens: int  # ids returned to lm-eval (after the stop cut)
    committed: int  # ids the decoder committed (can exceed gen_tokens past a stop)
    rounds: int
    accepted_per_round: float  # mean drafted edges accepted per round (0 for control)
    latency_s: float  # this request's start to finish (overlaps its batch-mates' at batch size > 1)
    stop_reason: str
    host_bytes: int = 0  # read back from the target's device
    forward_s: float = 0.0  # round time in target forwards / drafting / the rest (transitions, verification)
    draft_s: float = 0.0
    rest_s: float = 0.0
    # Cross-block lookahead: forwards that carried a lookahead row, blocks finished exactly as that row said,
    # later blocks whose first round drafted from it, and blocks begun after the first.
    lookahead_rows: int = 0
    lookahead_exact: int = 0
    lookahead_used: int = 0
    later_blocks: int = 0
    unknown_ids: int = 0  # generated ids the tokenizer has no token for (decoded as nothing; lm_eval_spot.tokens)


@dataclass
class RunStats:
    mode: str
    budget: int | None = None
    temperature: float | None = None
    exact_prefix_cache: bool = True  # the target's cache equals a full recomputation (else "approximate")
    batch_size: int | str = 1
    samples: list[SampleStats] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)  # per sample (ranks' statistics are merged by add)
    truncations: list[tuple[int, float]] = field(default_factory=list)  # per sample: (top_k, top_p) as decoded
    _nfe_sum: int = 0
    # Wall time of lm-eval's generate calls (what the user waited) and of the method's own decoding calls inside
    # them (less when control=paired also decodes draft-free); summed over calls, the slowest rank's when merged.
    call_wall_s: float = 0.0
    decode_wall_s: float = 0.0
    # Steps of the batched decode (every live request's round once) and the model forwards they ran, summed
    # over ranks: forwards per step is 1 where the live requests share one forward (2 with cache=approx builds).
    steps: int = 0
    forwards: int = 0

    def add(self, s: SampleStats, temperature: float, top_k: int = 0, top_p: float = 1.0) -> None:
        self.samples.append(s)
        self.temperatures.append(temperature)
        self.truncations.append((top_k, top_p))
        self._nfe_sum += s.nfe
        # A run mixing temperatures reports "mixed": the ratios below are only meaningful per temperature.
        if self.temperature is None or self.temperature == temperature:
            self.temperature = temperature
        else:
            self.temperature = float("nan")

    def add_steps(self, steps: int, forwards: int) -> None:
        self.steps += steps
        self.forwards += forwards

    def add_call(self, wall_s: float, decode_wall_s: float) -> None:
        """One generate call's wall time and the method's decoding time within it."""
        self.call_wall_s += wall_s
        self.decode_wall_s += decode_wall_s

    @property
    def nfe_mean(self) -> float:
        """Running NFE per sample, kept as a counter so a progress bar can show it on every request cheaply."""
        return self._nfe_sum / len(self.samples) if self.samples else 0.0

    def summary(self) -> dict[str, Any]:
        """The run's figures. With no request decoded (lm-eval's cache served them all) the per-sample figures
        are absent, not 0: nothing was measured."""
        n = len(self.samples)
        if not n:
            return {"mode": self.mode, "budget": self.budget, "batch_size": self.batch_size,
                    "prefix_cache": "exact" if self.exact_prefix_cache else "approximate",
                    "exact_prefix_cache": self.exact_prefix_cache, "samples": 0, "temperature": self.temperature,
                    "top_k": None, "top_p": None, "nfe_total": 0, "gen_tokens_total": 0, "committed_tokens_total": 0,
                    "rounds_total": 0, "wall_s": self.call_wall_s, "decode_wall_s": self.decode_wall_s}
        nfe = sum(s.nfe for s in self.samples)
        gen = sum(s.gen_tokens for s in self.samples)
        com = sum(s.committed for s in self.samples)
        latency = [s.latency_s for s in self.samples]
        rounds = sum(s.rounds for s in self.samples)
        fwd, dft, rest = (sum(getattr(s, k) for s in self.samples) for k in ("forward_s", "draft_s", "rest_s"))
        spent = fwd + dft + rest
        return {
            "mode": self.mode,
            "budget": self.budget,
            "batch_size": self.batch_size,
            "prefix_cache": "exact" if self.exact_prefix_cache else "approximate",
            "exact_prefix_cache": self.exact_prefix_cache,
            "samples": n,
            "temperature": self.temperature,
            # top-k / top-p as the draws used them (0 / 1.0: off, and always so at T = 0); "mixed" across tasks.
            "top_k": _one_or_mixed([k for k, _ in self.truncations]),
            "top_p": _one_or_mixed([p for _, p in self.truncations]),
            "nfe_total": nfe,
            "nfe_per_sample": nfe / n if n else 0.0,
            "nfe_median": median(s.nfe for s in self.samples) if n else 0.0,
            "gen_tokens_total": gen,
            "gen_tokens_per_sample": gen / n if n else 0.0,
            "committed_tokens_total": com,
            "tokens_per_forward": com / nfe if nfe else 0.0,
            "rounds_total": rounds,
            "steps_total": self.steps,
            "forwards_total": self.forwards,
            "forwards_per_step": self.forwards / self.steps if self.steps else 0.0,
            "mean_accepted_per_round": (
                mean(s.accepted_per_round for s in self.samples) if n else 0.0
            ),
            "wall_s": self.call_wall_s,
            "decode_wall_s": self.decode_wall_s,
            "gen_tokens_per_s": gen / self.decode_wall_s if self.decode_wall_s > 0 else 0.0,
            "request_latency_s_mean": mean(latency) if n else 0.0,
            "request_latency_s_median": median(latency) if n else 0.0,
            "stop_reasons": {r: sum(s.stop_reason == r for s in self.samples) for r in ("eos", "until", "length")},
            "host_bytes_per_round": sum(s.host_bytes for s in self.samples) / rounds if rounds else 0.0,
            "lookahead": _lookahead(self.samples),
            "unknown_token_ids": sum(s.unknown_ids for s in self.samples),
            # Shares of the rounds' time (per request; batched requests share their forwards' time).
            "round_time_shares": {"forward": fwd / spent, "drafting": dft / spent, "rest": rest / spent}
            if spent > 0 else {},
        }


def nfe_by_tenth(nfe: list[int]) -> list[float]:
    """Mean NFE per sample over each tenth of the requests in decoding order (fewer parts below 10 samples)."""
    n = len(nfe)
    parts = min(10, n)
    bounds = [round(i * n / parts) for i in range(parts + 1)] if parts else []
    return [sum(nfe[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:]) if b > a]


def _one_or_mixed(values: list[Any]) -> Any:
    return values[0] if values and all(v == values[0] for v in values) else ("mixed" if values else None)


def _lookahead(samples: list[SampleStats]) -> dict[str, Any]:
    rows, exact, used, later = (sum(getattr(s, k) for s in samples) for k in
                                ("lookahead_rows", "lookahead_exact", "lookahead_used", "later_blocks"))
    return {"rows": rows, "exact": exact, "used": used, "later_blocks": later,
            "exact_share": exact / rows if rows else 0.0, "later_blocks_served": used / later if later else 0.0}


def format_summary(summary: dict[str, Any]) -> str:
    """A short Markdown table for the end of a run."""
    served = summary.get("served_from_cache")
    if not summary["samples"]:
        why = (f"all {served} answers came from lm-eval's --use_cache cache" if served
               else "no generate request reached the decoder" + (" (--use_cache is the likely reason)"
                                                                   if served is not None else ""))
        rows = [("mode", summary["mode"]), ("samples decoded", 0), ("NOTE", f"no request was decoded: {why}; "
                                                                            "there are no NFE or speed figures")]
        return _table(rows)
    rows = [
        ("mode", summary["mode"]),
        ("samples", summary["samples"]),
        ("temperature", summary["temperature"]),
        *([("top_k / top_p", f"{summary['top_k']} / {summary['top_p']}")]
          if (summary.get("top_k") or 0) != 0 or summary.get("top_p", 1.0) != 1.0 else []),
        ("budget D", summary.get("budget")),
        *([("drafter", summary["drafter"] or "none (conf-tree)")] if "drafter" in summary else []),
        ("NFE / sample", f"{summary['nfe_per_sample']:.2f}"),
        ("generated tokens / sample", f"{summary['gen_tokens_per_sample']:.2f}"),
        ("tokens / forward", f"{summary['tokens_per_forward']:.3f}"),
        ("accepted / round", f"{summary['mean_accepted_per_round']:.3f}"),
        ("generated tokens / s", f"{summary['gen_tokens_per_s']:.1f}"),
        ("batch size", summary.get("batch_size", 1)),
        *([("target forwards / step (requests sharing them)", f"{summary['forwards_per_step']:.2f}")]
          if summary.get("steps_total") else []),
        ("wall s (generate calls)", f"{summary['wall_s']:.1f}"),
        ("request latency s (median)", f"{summary.get('request_latency_s_median', 0.0):.2f}"),
        ("prefix cache", summary.get("prefix_cache", "exact")),
        ("bytes to host / round", f"{summary.get('host_bytes_per_round', 0.0):,.0f}"),
    ]
    if "control_nfe_per_sample" in summary:  # paired: the wall above includes the draft-free decodes
        rows.append(("decoding s (this mode alone)", f"{summary.get('decode_wall_s', 0.0):.1f}"))
    la = summary.get("lookahead") or {}
    if la.get("rows"):
        rows.append(("lookahead rows: exact / blocks served",
                     f"{la['exact']} of {la['rows']} / {la['used']} of {la['later_blocks']} later blocks"))
    shares = summary.get("round_time_shares") or {}
    if shares:
        rows.append(("round time: forward / drafting / rest",
                     " / ".join(f"{100 * shares[k]:.0f}%" for k in ("forward", "drafting", "rest"))))
    for key, label in (
        ("control_nfe_per_sample", "control NFE / sample"),
        ("nfe_reduction", "NFE reduction vs control"),
        ("throughput_ratio", "throughput ratio vs control"),
        ("exact_match_to_control", "exact match to control"),
    ):
        if key in summary:
            rows.append((label, f"{summary[key]:.3f}" if isinstance(summary[key], float) else summary[key]))
    if summary.get("unknown_token_ids"):
        rows.append(("generated ids the tokenizer does not know (decoded as nothing)", summary["unknown_token_ids"]))
    if served:
        rows.append(("served from --use_cache (not decoded, not in these figures)", served))
        rows.append(("NOTE", f"the figures above cover the {summary['samples']} decoded requests only"))
    elif served is not None and served < 0:
        rows.append(("served from --use_cache", "some (count unknown); the figures cover the decoded requests"))
    adapt = summary.get("adapt") or {}
    for a in adapt.get("per_rank", [adapt] if adapt else []):
        rank = f" (rank {a['rank']})" if "per_rank" in adapt else ""
        share = f", {100 * a['share_of_wall']:.1f}% of the wall" if a.get("share_of_wall") is not None else ""
        rows.append((f"online adaptation{rank}", f"{a['examples']} examples from {a['requests']} requests, "
                                                 f"{a['update_steps']} steps, {a['seconds'] + a['recording_s']:.1f} s"
                                                 f"{share}"))
        rows.append((f"NFE / sample by tenth{rank}", " ".join(f"{x:.1f}" for x in a["nfe_by_tenth"])))
    pol = summary.get("budget_policy") or {}
    if pol:
        shares = pol.get("drafted_rows_share") or {}
        rows.append(("budget=auto: rounds by drafted rows", ", ".join(f"{d}: {100 * s:.0f}%" for d, s in shares.items())
                     or "none"))
        drafters = pol.get("drafters") or {}
        if drafters:
            rows.append(("budget=auto: drafting rounds by drafter", ", ".join(
                f"{name}: {100 * d['share_of_drafting_rounds']:.0f}% ({d['draft_ms']['per_request']:.2f} ms a round)"
                for name, d in drafters.items())))
        curve = pol.get("cost_curve_ms") or {}
        shown = [r for r in curve if r in ("1", "2", "4", "8", "16")] + list(curve)[-1:]
        rows.append(("budget=auto: forward ms by rows (start-up)",
                     ", ".join(f"{r}: {curve[r]:.2f}" for r in dict.fromkeys(shown))))
        rows.append(("budget=auto: start-up measurement s", f"{pol.get('startup_s', 0.0):.2f}"))
    if summary.get("drafter_note"):
        rows.append(("NOTE", summary["drafter_note"]))
    if summary.get("prefix_cache") == "approximate":
        rows.append(("NOTE", "approximate prefix cache: not lossless against full recomputation"))
    return _table(rows)


def _table(rows: list[tuple[str, Any]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = ["| spot-dlm | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


@dataclass
class PairedStats:
    """Control decoded on the same request in the same process: exactness and paired ratios.

    The throughput ratio is per request (its tokens over its latency, method against control), then the median.
    At batch size > 1 both members of a pair run under the same batch conditions: control decodes the same segment
    of requests together, in the same batch, right before or after the method (the order alternates per segment)."""

    nfe: list[tuple[int, int]] = field(default_factory=list)  # (method, control) per sample
    rate: list[tuple[float, float]] = field(default_factory=list)  # generated tokens / s, (method, control)
    same: list[bool] = field(default_factory=list)

    def add(self, method: Any, control: Any) -> None:
        """method/control: DecodeResult of the same request and seed."""
        self.nfe.append((method.nfe.total, control.nfe.total))
        self.rate.append((len(method.token_ids) / method.wall_s, len(control.token_ids) / control.wall_s))
        self.same.append(method.token_ids == control.token_ids)

    def extend(self, other: PairedStats) -> None:
        self.nfe.extend(other.nfe)
        self.rate.extend(other.rate)
        self.same.extend(other.same)

    def summary(self) -> dict[str, Any]:
        n = len(self.same)
        if not n:
            return {}
        m_nfe = sum(a for a, _ in self.nfe)
        c_nfe = sum(b for _, b in self.nfe)
        ratios = [a / b for a, b in self.rate if b > 0]
        return {
            "control_nfe_per_sample": c_nfe / n,
            "nfe_reduction": c_nfe / m_nfe if m_nfe else 0.0,
            "throughput_ratio": median(ratios) if ratios else 0.0,
            "throughput_ratio_q25_q75": _quartiles(ratios),
            "exact_match_to_control": sum(self.same) / n,
            "samples_differing_from_control": n - sum(self.same),
        }


def _quartiles(xs: list[float]) -> list[float]:
    if not xs:
        return [0.0, 0.0]
    s = sorted(xs)
    return [s[int(0.25 * (len(s) - 1))], s[int(0.75 * (len(s) - 1))]]
