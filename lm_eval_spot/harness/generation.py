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
from lm_eval_spot.settings.args import SpotArgs
from lm_eval_spot.decoding.batch import DecodeRequest, StepTally, decode_many
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

# Under budget=auto with adapt=auto, online adaptation (recording each commit, training between chunks) runs on a
# chunk only when the policy drafted in at least this share of the previous chunk's rounds (so never on the first):
# where drafting does not pay (a batch whose forward is compute-bound), a better drafter would not be used either,
# and its cost would be pure loss. adapt=online adapts on every chunk.
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
        self._drafted_share: float | None = None  # the policy's share of drafting rounds in the last chunk
        self.adapt_skipped = 0  # chunks decoded without adaptation (budget=auto drafted too little before them)

    def generate(self, jobs: list[PlannedRequest], batch_size: int, on_text: Callable[[PlannedRequest, str], None],
                 progress: bool) -> CallReport:
        """Decode `jobs` (already validated) in chunks of `batch_size`; `on_text(job, text)` as each chunk's texts
        are ready (lm-eval's cache hook). Records every sample and the call's times; flushes drafter_data and
        writes drafter_out at the end."""
        t_call, decode_s = time.perf_counter(), self.decode_s
        texts: list[str] = [""] * len(jobs)
        text = self.setup.text
        bar = tqdm(total=len(jobs), desc=f"spot-dlm [{self.setup.args.mode}]", disable=not progress)
        for c, start in enumerate(range(0, len(jobs), batch_size)):
            chunk = jobs[start : start + batch_size]
            # With paired control, which of the two runs first alternates per chunk: machine drift cancels.
            done = self.run_chunk(chunk, c % 2 == 1)
            for k, (job, (txt, result)) in enumerate(zip(chunk, done, strict=True)):
                texts[start + k] = txt
                unknown = text.count_unknown(result.token_ids)
                self.stats.add(sample_stats(result, unknown), job.cfg.temperature, job.cfg.top_k, job.cfg.top_p)
                self.sample_log.append(sample_entry(job.context, result, unknown))
                on_text(job, txt)
                bar.update(1)
            bar.set_postfix(nfe=f"{self.stats.nfe_mean:.1f}")
        bar.close()
        self.end_call()
        report = CallReport(texts, time.perf_counter() - t_call, self.decode_s - decode_s)
        if jobs:
            self.stats.add_call(report.wall_s, report.decode_s)
        return report

    def run_chunk(self, chunk: list[PlannedRequest], control_first: bool) -> list[tuple[str, DecodeResult]]:
        """Decode a chunk of requests together; with paired control, also decode them draft-free (first, when
        the proposers read that decode, as the oracle does)."""
        source, n = self.setup.proposers, len(chunk)
        if self.paired is None:
            return self._timed_decode(chunk, source.for_chunk(n, None))
        watch = source.watch_control(n)
        runs = {}
        for use_proposer in (False, True) if control_first or source.reads_control else (True, False):
            runs[use_proposer] = (self._timed_decode(chunk, source.for_chunk(n, watch)) if use_proposer
                                  else self._decode_jobs(chunk, [None] * n, watch))
        for d, c in zip(runs[True], runs[False], strict=True):
            self.paired.add(d[1], c[1])
        return runs[True]

    def _timed_decode(self, chunk: list[PlannedRequest],
                      proposers: list[Proposer | None]) -> list[tuple[str, DecodeResult]]:
        """The method's own decoding of a chunk, its wall time added to the run's decoding time (with
        drafter_data, its commits recorded; with online adaptation, the drafter trained on them once the chunk is
        done: both costs are part of the time it adds)."""
        t0 = time.perf_counter()
        recording, online = self.recording, self.online
        policy = self.setup.policy
        if online is not None and policy is not None and self.setup.args.adapt == "auto" and (
                self._drafted_share is None or self._drafted_share < ADAPT_MIN_DRAFTED):
            online = None
            self.adapt_skipped += 1
        before = dict(policy.report.drafted_rows) if policy is not None else {}
        # One recorder per request feeds both (ids unique over the run: the buffer and the shards tell requests apart).
        source = recording if recording is not None else online
        recs = [source.recorder() for _ in chunk] if source is not None else None
        tally = StepTally()
        out = self._decode_jobs(chunk, proposers, recs, tally)
        self.stats.add_steps(tally.steps, tally.forwards)  # the method's own decoding only (not paired control's)
        if recs is not None:
            for rec, (_, res) in zip(recs, out, strict=True):
                t1 = time.perf_counter()
                records = rec.result(self.setup.adapter.info.mask_id)
                spent = time.perf_counter() - t1
                if recording is not None:
                    recording.add_records(records, res.observe_s + spent)
                if online is not None:
                    online.add(records)
                    self.adapt_observe_s += res.observe_s + spent
        if online is not None:
            online.update()  # between chunks: every round of the next chunk reads the new weights
        if policy is not None:
            rounds = {d: c - before.get(d, 0) for d, c in policy.report.drafted_rows.items()}
            total = sum(rounds.values())
            self._drafted_share = (total - rounds.get(0, 0)) / total if total else None
        self.decode_s += time.perf_counter() - t0
        return out

    def _decode_jobs(
        self, chunk: list[PlannedRequest], proposers: list[Proposer | None], observers: list[Any] | None = None,
        tally: StepTally | None = None,
    ) -> list[tuple[str, DecodeResult]]:
        """Decode the chunk's requests together (one at a time when batch_size is 1); texts cut at `until`;
        `tally` adds the steps and model forwards run."""
        decode_ids = self.setup.text
        jobs = [
            DecodeRequest(list(job.prompt_ids), job.cfg, job.seed, make_stop_check(decode_ids, job.until),
                      prop, observers[i] if observers else None,
                      self.setup.args.verify if prop is not None else "coupled")
            for i, (job, prop) in enumerate(zip(chunk, proposers, strict=True))
        ]
        try:
            # The step policy prices the method's own decodes; paired control's rounds draft nothing anyway.
            drafting = any(prop is not None for prop in proposers)
            results = decode_many(self.setup.adapter, jobs, batch_size=len(jobs), tally=tally,
                                  policy=self.setup.policy if drafting else None)
        except NonFiniteLogitsError as err:
            from lm_eval.utils import hash_string

            job = chunk[err.request or 0]
            raise err.with_message(
                f"spot-dlm: {err} while decoding the request whose prompt ends {preview(job.context)} "
                f"(prompt_hash {hash_string(job.context)}); nothing of this run was written") from None
        return [(cut_text(decode_ids(r.token_ids), job.until), r) for job, r in zip(chunk, results, strict=True)]

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
