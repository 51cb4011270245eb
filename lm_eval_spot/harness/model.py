"""The `spot-dlm` lm-eval model: generation through exact block-diffusion decoding, with NFE and speed counted."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from lm_eval_spot import __version__
from lm_eval_spot.harness.batch_size import auto_batch_size
from lm_eval_spot.budget import MAX_BUDGET
from lm_eval_spot.settings.cards import parse_model_args
from lm_eval_spot.harness.chat import apply_chat, chat_template_of, tokenizer_name
from lm_eval_spot.settings.args import SpotArgs, default_graph_path, merge_harness_args, shipped_drafter_path
from lm_eval_spot.decoding.loop import DecodeConfig, DecodeResult
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.harness.distributed import Ranks, detect_ranks, padding_count, rank_device
from lm_eval_spot.drafter.online import OnlineAdapter, adapt_across_ranks, online_adapter_for
from lm_eval_spot.drafter.recording import DrafterDataWriter
from lm_eval_spot.families import load_target
from lm_eval_spot.families.common import with_concrete_dtype
from lm_eval_spot.harness.jobs import Job, RequestError, plan_jobs
from lm_eval_spot.likelihood.harness import format_likelihood
from lm_eval_spot.likelihood.runner import LikelihoodRunner, RunnerSetup
from lm_eval_spot.settings.proposers import build_proposer
from lm_eval_spot.harness.generation import GenerationRunner, GenerationSetup
from lm_eval_spot.reports.run_stats import PairedStats, RunStats, format_summary
from lm_eval_spot.settings.modes import MODES
from lm_eval_spot.harness.request_cache import RequestCache, run_fingerprint
from lm_eval_spot.reports.summary import RankPart, merge_ranks, run_summary, sample_entry, sample_stats
from lm_eval_spot.settings.threads import choose_threads, decoding_threads, default_thread_counts
from lm_eval_spot.tokens import TextDecoder

# A child of lm-eval's logger: its CLI shows these messages (run summary, load facts) with its own.
log = logging.getLogger("lm_eval.spot")

__all__ = ["RequestError", "SpotDLM"]  # RequestError: raised by job planning, part of this class's interface


class SpotDLM(LM):
    """lm-eval model `spot-dlm`. Model args: see `lm_eval_spot.settings.args.SpotArgs` and the README."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args: SpotArgs = parse_model_args(kwargs)  # raises before anything is loaded
        self.ranks: Ranks = detect_ranks(self.args.device)
        self._rank, self._world_size = self.ranks.rank, self.ranks.world_size
        if rank_device(self.args.device, self.ranks) != self.args.device:
            self.args = replace(self.args, device=rank_device(self.args.device, self.ranks))
        # dtype=auto becomes the dtype it names on this device: the summary, the results and the request cache's
        # fingerprint all read the resolved one.
        self.args = with_concrete_dtype(self.args)
        loaded = load_target(self.args)
        self.adapter = loaded.adapter
        self.tokenizer = loaded.tokenizer
        self.text = TextDecoder.for_target(self.tokenizer, self.adapter.info.vocab_size)
        self._device = torch.device(self.adapter.device)  # lm-eval builds its rank-count tensors on it
        model = getattr(self.adapter, "model", None)
        n_params = sum(p.numel() for p in model.parameters()) if model is not None else None
        self.threads = choose_threads(self.args.threads, self._device.type, n_params, os.environ,
                                      torch.get_num_threads(), default_thread_counts())
        log.info("spot-dlm: threads: %s", self.threads.reason)
        self.target = {"family": loaded.family, "impl": loaded.impl, "card": self.args.card,
                       "block_len": self.adapter.info.block_len, "mask_id": self.adapter.info.mask_id,
                       "stop_ids": sorted(self.adapter.info.stop_ids), "dtype": self.args.dtype}
        self.base_seed = self.args.seed if self.args.seed is not None else int(torch.initial_seed())
        choice = build_proposer(self.args, self.adapter)
        self.proposer, self.drafter_path, self.drafter_note = choice.proposer, choice.drafter, choice.note
        self.policy = choice.policy  # budget=auto's step policy (None: a fixed budget, or control)
        if self.drafter_path is not None and self.drafter_path.resolve() == shipped_drafter_path("transfer").resolve():
            log.info("spot-dlm: mode=%s drafts with the shipped transfer drafter (trained on tiny targets, not on %s): "
                     "outputs stay exact; a drafter trained on this target accepts more drafts: add "
                     "drafter_data=FOLDER to any run (control included), then python -m lm_eval_spot.training.train "
                     "train --data FOLDER --out D", self.args.mode, self.args.pretrained)
        recording = (DrafterDataWriter(Path(self.args.drafter_data), self.args.pretrained,
                                       self.adapter.info.block_len, self.adapter.info.mask_id, self.rank)
                     if self.args.drafter_data else None)
        online = online_adapter_for(self.args, self.proposer, self.drafter_path,
                                    mix_seed(self.base_seed, "adapt", self.rank) & 0xFFFFFFFF)
        self._gathered_adapt: dict[str, Any] | None = None
        drafting = self.args.mode != "control"
        stats = RunStats(mode=self.args.mode, budget=self.args.budget if drafting else None,
                         exact_prefix_cache=self.adapter.info.exact_prefix_cache, batch_size=self.args.batch_size)
        # The oracle needs the control run of each request anyway: it is always paired.
        paired = drafting and (self.args.control == "paired" or self.args.mode == "oracle")
        self.generation = GenerationRunner(
            GenerationSetup(self.adapter, self.args, self.proposer, self.decode_ids, recording, online,
                            self.policy), stats,
            PairedStats() if paired else None)
        self._auto_bs: int | None = None
        self._auto_lik_bs: int | None = None
        # Per request, in lm-eval's request order: joined with its samples file by `prompt_hash` (compare.py).
        self.sample_log: list[dict[str, Any]] = []
        # Every rank's statistics, gathered at the end of each generate_until (None: single process).
        self._gathered: RankPart | None = None
        self.request_cache: RequestCache | None = None  # set when lm-eval runs with --use_cache
        self._summary_logged = False
        prefix = self.tokenizer.eos_token_id
        self.likelihood = LikelihoodRunner(
            RunnerSetup(self.adapter, self.encode, int(prefix if prefix is not None else self.adapter.info.mask_id),
                        self.base_seed, self._likelihood_batch), self.args)
        if self.args.batch_invariant and self.args.batch_size not in (1, "auto"):
            log.info("batch_invariant=true: requests are decoded one at a time (batch_size=%s ignored)",
                     self.args.batch_size)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict[str, Any] | None = None) -> SpotDLM:
        """lm-eval's CLI path: `--model_args` plus its own device / batch size, without a duplicate-keyword clash."""
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict[str, Any] | None = None) -> SpotDLM:
        merged, notes = merge_harness_args(dict(arg_dict), dict(additional_config or {}))
        for note in notes:
            log.info("spot-dlm: %s", note)
        return cls(**merged)

    # ---- lm-eval verbs ----------------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log p(continuation | context), is_greedy) by the masked-diffusion bound (`lm_eval_spot.likelihood`)."""
        return self._likelihood_verb("loglikelihood", self.likelihood.loglikelihood, requests, disable_tqdm)

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """A document's log-likelihood: the bound summed over lm-eval's disjoint rolling windows."""
        return self._likelihood_verb("loglikelihood_rolling", self.likelihood.loglikelihood_rolling, requests,
                                     disable_tqdm)

    def _likelihood_verb(self, verb: str, score: Any, requests: list[Any], disable_tqdm: bool) -> list[Any]:
        """Score the real requests (lm-eval's padding copies get the last real answer, never scored), feed
        --use_cache, and log the summary (multi-process runs log the summed one at the barrier)."""
        n_pad = padding_count(requests) if self.ranks.distributed else 0
        real = requests[: len(requests) - n_pad]
        with decoding_threads(self.threads):
            out = score(real, disable_tqdm or self.rank != 0)
        for req, o in zip(real, out, strict=True):
            self.cache_hook.add_partial(verb, req.args, o)
        if out and not self.ranks.distributed:
            self._log_likelihood()
        return out + [out[-1]] * n_pad if out else out

    def _log_likelihood(self) -> None:
        stats = self._gathered.likelihood if self._gathered is not None else self.likelihood.stats
        log.info("%s", format_likelihood(stats.summary(), self.likelihood.settings))

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        # lm-eval's padding copies (multi-process runs) are answered with the real request's text, never decoded
        # or counted: the summed statistics then equal a single-process run's.
        t_call = time.perf_counter()
        gen = self.generation
        decode_s = gen.decode_s
        n_pad = padding_count(requests) if self.ranks.distributed else 0
        real = requests[: len(requests) - n_pad]
        # Every request is validated before the first one is decoded: nothing half-done on bad input.
        jobs = self._plan(real)
        out: list[str] = [""] * len(jobs)
        bs = self._batch_size()
        with decoding_threads(self.threads):
            bar = tqdm(total=len(jobs), desc=f"spot-dlm [{self.args.mode}]", disable=disable_tqdm or self.rank != 0)
            for c, start in enumerate(range(0, len(jobs), bs)):
                chunk = jobs[start : start + bs]
                # With paired control, which of the two runs first alternates per chunk: machine drift cancels.
                done = gen.run_chunk(chunk, c % 2 == 1)
                for k, (job, (text, result)) in enumerate(zip(chunk, done, strict=True)):
                    out[start + k] = text
                    self._record(result, job.cfg)
                    self.sample_log.append(sample_entry(job.context, result, self.text.count_unknown(result.token_ids)))
                    self.cache_hook.add_partial("generate_until", (job.context, job.raw_kwargs), text)
                    bar.update(1)
                bar.set_postfix(nfe=f"{self.stats.nfe_mean:.1f}")
        bar.close()
        gen.end_call(Path(self.args.drafter_out).expanduser() if self.args.drafter_out else None,
                     self.args.pretrained, f"rank_{self.rank}" if self.ranks.distributed else None)
        if jobs:
            self.stats.add_call(time.perf_counter() - t_call, gen.decode_s - decode_s)
        # Multi-process runs log the summed summary at lm-eval's barrier, which every rank reaches (a rank whose
        # requests all came from --use_cache never calls this method).
        if jobs and not self.ranks.distributed:
            self._log_summary()
        return out + [out[-1]] * n_pad if out else out

    # The generation runner's state, as the rest of the class (and its users) read it.
    @property
    def stats(self) -> RunStats:
        return self.generation.stats

    @property
    def paired(self) -> PairedStats | None:
        return self.generation.paired

    @property
    def online(self) -> OnlineAdapter | None:
        return self.generation.online

    @property
    def recording(self) -> DrafterDataWriter | None:
        return self.generation.recording

    def _log_summary(self) -> None:
        self._summary_logged = True
        log.info("spot-dlm run summary\n%s", format_summary(self.get_model_info()["spot"]))

    def _gather_stats(self) -> None:
        """Sum every rank's statistics (all ranks call this: it is a collective)."""
        parts = self.ranks.all_gather_object(self._own_part())
        self._gathered_adapt = adapt_across_ranks([p.adapt for p in parts if p.adapt is not None])
        self._gathered = merge_ranks(parts)

    def _own_part(self) -> RankPart:
        return RankPart(self.stats, self.paired, self.sample_log, self._cache_served(), self.likelihood.stats,
                        self.likelihood.samples, self.generation.adapt_summary(self.rank))

    def _pad_rows(self) -> int:
        """batch_invariant: every forward carries 1 + the largest budget rows (budget=auto's: MAX_BUDGET)."""
        if not self.args.batch_invariant:
            return 0
        return 1 + (self.args.budget if isinstance(self.args.budget, int) else MAX_BUDGET)

    def _likelihood_batch(self) -> int:
        """Likelihood requests scored together (each forward carries up to mc_batch rows per request)."""
        if self.args.batch_invariant:
            return 1
        if self.args.batch_size != "auto":
            return int(self.args.batch_size)
        if self._auto_lik_bs is None:
            self._auto_lik_bs = auto_batch_size(self.adapter, self.args.mc_batch, self.args.max_batch_size)
        return self._auto_lik_bs

    def _batch_size(self) -> int:
        if self.args.batch_invariant:
            return 1  # other requests' rows would change the forward's shape again
        if self.args.batch_size != "auto":
            return int(self.args.batch_size)
        if self._auto_bs is None:
            budget = self.args.budget if isinstance(self.args.budget, int) else MAX_BUDGET
            rows = 1 if self.args.mode == "control" else 1 + budget
            self._auto_bs = auto_batch_size(self.adapter, rows, self.args.max_batch_size)
        return self._auto_bs

    def _plan(self, requests: list[Any]) -> list[Job]:
        return plan_jobs(requests, self.encode, self.tokenizer, self.adapter.info, self.args, self.base_seed,
                         self._pad_rows())

    # ---- pieces -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode_ids(self, ids: list[int]) -> str:
        return self.text(ids)

    def _record(self, r: DecodeResult, cfg: DecodeConfig) -> None:
        self.stats.add(sample_stats(r, self.text.count_unknown(r.token_ids)), cfg.temperature, cfg.top_k, cfg.top_p)

    # ---- lm-eval hooks -------------------------------------------------------------------------------
    def set_cache_hook(self, cache_hook: Any) -> None:
        """--use_cache: claim the file for this configuration (or refuse it) before lm-eval serves any answer."""
        db = getattr(cache_hook, "dbdict", None)
        if db is not None:
            self.request_cache = RequestCache.claim(db, self.cache_fingerprint())
        super().set_cache_hook(cache_hook)

    def cache_fingerprint(self) -> str:
        """Everything that decides the generated ids: the args, the seed, the device type, the files read."""
        graph = (self.args.graph or str(default_graph_path())) if self.args.mode == "graph" else None
        drafter = str(self.drafter_path) if self.drafter_path is not None else None
        return run_fingerprint(vars(self.args), self.base_seed, self.device.type, __version__, self.target, drafter,
                               graph)

    def _cache_served(self) -> int | None:
        return self.request_cache.served if self.request_cache is not None else None

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.ranks.all_gather(tensor)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return self.ranks.gather_object(obj, dst)

    def barrier(self) -> None:
        """lm-eval calls this on every rank after each request type: the point to sum the ranks' statistics."""
        if self.ranks.distributed:
            self._gather_stats()
            if self.rank == 0:
                assert self._gathered is not None
                if self._gathered.stats.samples:
                    self._log_summary()
                if self._gathered.likelihood.requests:
                    self._log_likelihood()
        self.ranks.barrier()

    def get_model_info(self) -> dict[str, Any]:
        run = self._gathered or self._own_part()
        adapt = self._gathered_adapt if self._gathered is not None else run.adapt
        summary = run_summary(run, self.target, self.world_size, self.drafter_path, MODES[self.args.mode].learned,
                              self.drafter_note, adapt, self.likelihood.settings)
        if self.policy is not None:
            summary["budget_policy"] = self.policy.summary()  # this process's (each rank measures and learns its own)
        if run.served and not self._summary_logged:  # every request came from --use_cache: nothing was decoded
            self._summary_logged = True
            log.info("spot-dlm run summary\n%s", format_summary({k: v for k, v in summary.items()
                                                                  if k != "likelihood"}))
        return {
            "spot": summary,
            "spot_likelihood_samples": run.likelihood_samples,
            "spot_target": self.target,
            "spot_samples": run.samples,
            "spot_args": {k: v for k, v in vars(self.args).items()},
        }

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The template --apply_chat_template uses, as lm-eval's HF model gives it (the results record its hash)."""
        return chat_template_of(self.tokenizer, chat_template)

    @property
    def tokenizer_name(self) -> str:
        return tokenizer_name(self.tokenizer)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return apply_chat(self.tokenizer, chat_history, add_generation_prompt)
