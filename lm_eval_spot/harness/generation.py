"""The owner of a generate_until call: planned jobs in chunks through the batched decoder, the paired control run,
what rides on the method's own decodes (drafter-data recording, online adaptation), and every write to the run's
statistics and per-request log. `harness/model.py` keeps lm-eval's verbs around it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from lm_eval_spot.adapters.base import TargetAdapter
from lm_eval_spot.budget import CanvasCheck
from lm_eval_spot.settings.args import SpotArgs
from lm_eval_spot.decoding.batch import DecodeRequest, Joining, StepTally, decode_many
from lm_eval_spot.decoding.loop import DecodeResult, NonFiniteLogitsError
from lm_eval_spot.decoding.proposer import Proposer, RequestProposers
from lm_eval_spot.decoding.step_policy import StepPolicy
from lm_eval_spot.drafter.online import OnlineAdapter
from lm_eval_spot.drafter.recording import DrafterDataWriter
from lm_eval_spot.errors import preview
from lm_eval_spot.harness.planning import PlannedRequest
from lm_eval_spot.harness.until import cut_text, make_stop_check
from lm_eval_spot.reports.run_stats import PairedStats, RunStats, nfe_by_tenth
from lm_eval_spot.reports.summary import sample_entry, sample_stats
from lm_eval_spot.tokens import TextDecoder

log = logging.getLogger("lm_eval.spot")

# Under budget=auto with adapt=auto, online adaptation (recording each commit, training between steps) runs on a
# wave (`batch_size` requests in join order) only when the policy drafted in at least this share of the rounds since
# the previous wave began (so never on the first): where drafting does not pay (a batch whose forward is
# compute-bound), a better drafter would not be used either, and its cost would be pure loss. adapt=online adapts on
# every wave.
ADAPT_MIN_DRAFTED = 0.1


@dataclass(frozen=True)
class GenerationSetup:
    adapter: TargetAdapter
    args: SpotArgs
    proposers: RequestProposers  # each request's proposer per chunk (one shared, None for control; per request)
    text: TextDecoder  # ids -> text (and the ids the tokenizer does not know, counted per sample)
    recording: DrafterDataWriter | None  # drafter_data=
    online: OnlineAdapter | None  # adapt=online
    policy: StepPolicy | None = None  # budget=auto: each step's drafted rows per request
    drafter_out: Path | None = None  # drafter_out=: where the adapted drafter is written after each call
    rank_folder: str | None = None  # this process's subfolder of drafter_out when several processes adapt
    canvas: CanvasCheck | None = None  # budget=auto: the start-up curve taken again at the first requests' canvas


@dataclass(frozen=True)
class CallReport:
    """One generate_until call as the runner ran it."""

    texts: list[str]  # per job, in order, cut at its `until`
    wall_s: float  # the call's wall time
    decode_s: float  # the method's own decoding time within it (paired control's decodes excluded)


class GenerationRunner:
    """Runs generate_until calls: chunks, paired control, recording, adaptation, and every statistics write (the
    run's `stats`, paired control's `paired`, and the per-request `sample_log`)."""

    def __init__(self, setup: GenerationSetup, stats: RunStats, paired: PairedStats | None) -> None:
        self.setup = setup
        self.stats = stats
        self.paired = paired  # with control=paired (always for the oracle): each request decoded draft-free too
        # Per request, in lm-eval's request order: joined with its samples file by `prompt_hash` (compare).
        self.sample_log: list[dict[str, Any]] = []
        self.decode_s = 0.0  # wall time of the method's own decoding calls (chunks, not requests), running total
        self.adapt_observe_s = 0.0  # recording's share of the decodes' time, for the adaptation's cost
        self.online, self.recording = setup.online, setup.recording
        self._wave_mark: dict[int, int] | None = None  # the policy's rounds by drafted rows when the last wave began
        self.adapt_skipped = 0  # waves decoded without adaptation (budget=auto drafted too little before them)
        self._canvas_checked = False

    def generate(self, jobs: list[PlannedRequest], batch_size: int, on_text: Callable[[PlannedRequest, str], None],
                 progress: bool) -> CallReport:
        """Decode `jobs` (already validated) `batch_size` at a time; `on_text(job, text)` as each request finishes
        (lm-eval's cache hook). Records every sample (in job order) and the call's times; flushes drafter_data and
        writes drafter_out at the end.

        Without paired control the whole call is one continuous batch: a finished request's place goes to the next
        job at once, so a step never waits for a batch's longest request (a chunk of 8 GSM8K answers of 45-256
        tokens ran ~1.5x the steps its mean needs: docs/benchmarks.md, "Chunked against continuous batching").
        With paired control the call runs in segments of `batch_size` requests, each decoded by both methods in
        the same batch, the order alternating per segment (machine drift cancels)."""
        t_call, decode_s = time.perf_counter(), self.decode_s
        policy, canvas = self.setup.policy, self.setup.canvas
        if jobs and policy is not None and canvas is not None and not self._canvas_checked:
            # Start-up, as the measurement at construction: reported (`startup_s`), not part of the decoding time.
            self._canvas_checked = True
            canvas.fit(policy, [len(j.prompt_ids) for j in jobs], max(j.cfg.max_gen_toks for j in jobs))
        texts: list[str] = [""] * len(jobs)
        text = self.setup.text
        bar = tqdm(total=len(jobs), desc=f"spot-dlm [{self.setup.args.mode}]", disable=not progress)
        nfe_sum = [0, 0]  # the progress bar's running NFE mean (forwards, requests)

        def finished(job: PlannedRequest, txt: str, result: DecodeResult) -> None:
            on_text(job, txt)
            nfe_sum[0] += result.nfe.total
            nfe_sum[1] += 1
            bar.update(1)
            bar.set_postfix(nfe=f"{nfe_sum[0] / nfe_sum[1]:.1f}", refresh=False)

        size = len(jobs) if self.paired is None else batch_size
        for c, start in enumerate(range(0, len(jobs), max(1, size))):
            segment = jobs[start : start + size]
            done = self.run_segment(segment, batch_size, c % 2 == 1, finished)
            for k, (job, (txt, result)) in enumerate(zip(segment, done, strict=True)):
                texts[start + k] = txt
                unknown = text.count_unknown(result.token_ids)
                self.stats.add(sample_stats(result, unknown), job.cfg.temperature, job.cfg.top_k, job.cfg.top_p)
                self.sample_log.append(sample_entry(job.context, result, unknown))
        bar.close()
        self.end_call()
        report = CallReport(texts, time.perf_counter() - t_call, self.decode_s - decode_s)
        if jobs:
            self.stats.add_call(report.wall_s, report.decode_s)
        return report

    def run_segment(self, segment: list[PlannedRequest], batch_size: int, control_first: bool,
                    finished: Callable[[PlannedRequest, str, DecodeResult], None]) -> list[tuple[str, DecodeResult]]:
        """Decode a segment of requests `batch_size` at a time, `finished(job, text, result)` as each of the
        method's requests ends; with paired control, also decode them draft-free (first, when the proposers read
        that decode, as the oracle does)."""
        source, n = self.setup.proposers, len(segment)
        if self.paired is None:
            return self._timed_decode(segment, batch_size, source.for_chunk(n, None), finished)
        watch = source.watch_control(n)
        runs = {}
        for use_proposer in (False, True) if control_first or source.reads_control else (True, False):
            runs[use_proposer] = (self._timed_decode(segment, batch_size, source.for_chunk(n, watch), finished)
                                  if use_proposer else self._decode_jobs(segment, batch_size, [None] * n, watch))
        for d, c in zip(runs[True], runs[False], strict=True):
            self.paired.add(d[1], c[1])
        return runs[True]

    def _adapts_from(self, policy: StepPolicy | None) -> bool:
        """At the first join of each wave (`batch_size` requests in join order): whether online adaptation records
        and trains on this wave. Under budget=auto with adapt=auto, only when the policy drafted in at least
        ADAPT_MIN_DRAFTED of the rounds since the previous wave began (so never on the first)."""
        if self.online is None:
            return False
        if policy is None or self.setup.args.adapt != "auto":
            return True
        rows = dict(policy.report.drafted_rows)
        before, self._wave_mark = self._wave_mark, rows
        if before is None:
            self.adapt_skipped += 1
            return False
        rounds = {d: c - before.get(d, 0) for d, c in rows.items()}
        total = sum(rounds.values())
        if total and (total - rounds.get(0, 0)) / total >= ADAPT_MIN_DRAFTED:
            return True
        self.adapt_skipped += 1
        return False

    def _timed_decode(self, segment: list[PlannedRequest], batch_size: int, proposers: list[Proposer | None],
                      finished: Callable[[PlannedRequest, str, DecodeResult], None]) -> list[tuple[str, DecodeResult]]:
        """The method's own decoding of a segment, its wall time added to the run's decoding time. With
        drafter_data, each request's commits are recorded; with online adaptation, each finished request's commits
        join the buffer and the drafter trains between steps once enough are new (`OnlineAdapter.update`): never
        inside a round, at points fixed by the order in which requests finish. Both costs are part of the time."""
        t0 = time.perf_counter()
        recording, online, policy = self.recording, self.online, self.setup.policy
        recorders: dict[int, Any] = {}
        adapting = [False]

        def observer(i: int) -> Any:  # called as request i joins the batch
            if i % batch_size == 0:
                adapting[0] = self._adapts_from(policy)
            source = recording if recording is not None else online if adapting[0] else None
            if source is None:
                return None
            recorders[i] = (source.recorder(), adapting[0])
            return recorders[i][0]

        def done(i: int, txt: str, result: DecodeResult) -> None:
            if i in recorders:
                rec, adapts = recorders.pop(i)
                t1 = time.perf_counter()
                records = rec.result(self.setup.adapter.info.mask_id)
                spent = time.perf_counter() - t1
                if recording is not None:
                    recording.add_records(records, result.observe_s + spent)
                if online is not None and adapts:
                    online.add(records)
                    self.adapt_observe_s += result.observe_s + spent
                    online.update()  # between steps; it trains once `every` requests are new
            finished(segment[i], txt, result)

        tally = StepTally()
        out = self._decode_jobs(segment, batch_size, proposers, observer, tally, done)
        self.stats.add_steps(tally.steps, tally.forwards)  # the method's own decoding only (not paired control's)
        self.decode_s += time.perf_counter() - t0
        return out

    def _decode_jobs(
        self, segment: list[PlannedRequest], batch_size: int, proposers: list[Proposer | None],
        observers: list[Any] | Callable[[int], Any] | None = None, tally: StepTally | None = None,
        done: Callable[[int, str, DecodeResult], None] | None = None,
    ) -> list[tuple[str, DecodeResult]]:
        """Decode the segment's requests `batch_size` at a time (a finished one's place taken by the next); texts
        cut at `until`; `observers` per request (a list, or a function called as request i joins); `tally` adds the
        steps and model forwards run; `done(i, text, result)` as request i finishes."""
        decode_ids = self.setup.text
        verify = self.setup.args.verify

        def request(i: int) -> DecodeRequest:
            job, prop = segment[i], proposers[i]
            obs = observers(i) if callable(observers) else observers[i] if observers else None
            return DecodeRequest(list(job.prompt_ids), job.cfg, job.seed, make_stop_check(decode_ids, job.until),
                                 prop, obs, verify if prop is not None else "coupled")

        texts: dict[int, str] = {}  # each request's text, cut once as it finishes

        def on_done(i: int, r: DecodeResult) -> None:
            texts[i] = cut_text(decode_ids(r.token_ids), segment[i].until)
            if done is not None:
                done(i, texts[i], r)

        try:
            # The step policy prices the method's own decodes; paired control's rounds draft nothing anyway.
            drafting = any(prop is not None for prop in proposers)
            results = decode_many(self.setup.adapter, Joining(len(segment), request), batch_size=batch_size,
                                  tally=tally, policy=self.setup.policy if drafting else None, on_done=on_done)
        except NonFiniteLogitsError as err:
            from lm_eval.utils import hash_string

            job = segment[err.request or 0]
            raise err.with_message(
                f"spot-dlm: {err} while decoding the request whose prompt ends {preview(job.context)} "
                f"(prompt_hash {hash_string(job.context)}); nothing of this run was written") from None
        return [(texts[i], r) for i, r in enumerate(results)]

    def end_call(self) -> None:
        """After a generate_until call: drafter_data's shards flushed (and what recording cost logged); with
        drafter_out, the adapted drafter written (under the rank's folder when several processes adapt)."""
        recording, online = self.recording, self.online
        drafter_out, rank_folder = self.setup.drafter_out, self.setup.rank_folder
        target = self.setup.args.pretrained
        if recording is not None:
            recording.flush()
            r = recording.summary()
            log.info("spot-dlm: drafter_data: %d requests, %d commits in %d shards (%.1f MB) in %s; recording took "
                     "%.2f s, %.1f%% of this process's decoding time", r["requests"], r["commits"], r["shards"],
                     r["bytes"] / 1e6, r["folder"], r["seconds"], 100 * r["seconds"] / max(self.decode_s, 1e-9))
        if online is not None and drafter_out is not None:
            folder = drafter_out / rank_folder if rank_folder else drafter_out
            online.save(folder, target, self.setup.adapter.info.block_len)
            log.info("spot-dlm: drafter_out: the adapted drafter (%d examples, %d update steps) is in %s; the next "
                     "run loads it with drafter=%s", online.examples, online.steps, folder, folder)

    def adapt_summary(self, rank: int) -> dict[str, Any] | None:
        """This rank's adaptation: what it learned from, what it cost, and the NFE curve by tenth of its run."""
        online = self.online
        if online is None:
            return None
        out = online.summary()
        out["recording_s"] = round(self.adapt_observe_s, 3)
        out["chunks_skipped"] = self.adapt_skipped  # budget=auto drafted in too few rounds before them
        # Of the method's own decoding time (adaptation included; paired control's decodes are not the method's).
        wall = self.stats.decode_wall_s
        out["share_of_wall"] = (online.seconds + self.adapt_observe_s) / wall if wall > 0 else None
        out["nfe_by_tenth"] = nfe_by_tenth([smp.nfe for smp in self.stats.samples])
        out["rank"] = rank
        return out
