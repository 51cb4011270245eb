"""The `spot-dlm` lm-eval model: generation through exact block-diffusion decoding, with NFE and speed counted."""

from __future__ import annotations

import logging
from typing import Any

import torch
from lm_eval.api.model import LM

from lm_eval_spot import __version__
from lm_eval_spot.harness.build import build_parts
from lm_eval_spot.harness.chat import apply_chat, chat_template_of, tokenizer_name
from lm_eval_spot.harness.distributed import padding_count
from lm_eval_spot.harness.planning import PlannedRequest, RequestError, plan_requests
from lm_eval_spot.harness.request_cache import RequestCache, run_fingerprint
from lm_eval_spot.likelihood.harness import format_likelihood
from lm_eval_spot.drafter.online import adapt_across_ranks
from lm_eval_spot.reports.run_stats import format_summary
from lm_eval_spot.reports.summary import RankPart, merge_ranks, run_summary
from lm_eval_spot.settings.args import default_graph_path, merge_harness_args
from lm_eval_spot.settings.cards import parse_model_args
from lm_eval_spot.settings.modes import MODES
from lm_eval_spot.settings.threads import decoding_threads

# A child of lm-eval's logger: its CLI shows these messages (run summary, load facts) with its own.
log = logging.getLogger("lm_eval.spot")

__all__ = ["RequestError", "SpotDLM"]  # RequestError: raised by job planning, part of this class's interface


class SpotDLM(LM):
    """lm-eval model `spot-dlm`: lm-eval's verbs over the parts `harness.build` wires (model args: see
    `lm_eval_spot.settings.args.SpotArgs` and the README). A generate_until call is owned by `self.generation`,
    a likelihood call by `self.likelihood`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        parts = build_parts(parse_model_args(kwargs))  # the arguments raise before anything is loaded
        self.args, self.ranks, self.adapter, self.tokenizer = parts.args, parts.ranks, parts.adapter, parts.tokenizer
        self._rank, self._world_size = self.ranks.rank, self.ranks.world_size
        self.text, self.threads, self.target, self.base_seed = parts.text, parts.threads, parts.target, parts.base_seed
        self.proposer, self.drafter_path = parts.choice.proposer, parts.choice.drafter
        self.drafter_note, self.policy = parts.choice.note, parts.choice.policy  # policy: budget=auto's (or None)
        self.sizes, self.generation, self.likelihood = parts.sizes, parts.generation, parts.likelihood
        self._device = torch.device(self.adapter.device)  # lm-eval builds its rank-count tensors on it
        self._gathered: RankPart | None = None  # every rank's statistics, after a barrier (None: one process)
        self._gathered_adapt: dict[str, Any] | None = None
        self.request_cache: RequestCache | None = None  # set when lm-eval runs with --use_cache
        self._summary_logged = False

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
        n_pad = padding_count(requests) if self.ranks.distributed else 0
        real = requests[: len(requests) - n_pad]
        # Every request is validated before the first one is decoded: nothing half-done on bad input.
        jobs = self._plan(real)
        with decoding_threads(self.threads):
            out = self.generation.generate(jobs, self.sizes.generation(), self._cache_text,
                                           progress=not disable_tqdm and self.rank == 0).texts
        # Multi-process runs log the summed summary at lm-eval's barrier, which every rank reaches (a rank whose
        # requests all came from --use_cache never calls this method).
        if jobs and not self.ranks.distributed:
            self._log_summary()
        return out + [out[-1]] * n_pad if out else out

    def _cache_text(self, job: PlannedRequest, text: str) -> None:
        self.cache_hook.add_partial("generate_until", (job.context, job.raw_kwargs), text)

    def _log_summary(self) -> None:
        self._summary_logged = True
        log.info("spot-dlm run summary\n%s", format_summary(self.get_model_info()["spot"]))

    def _gather_stats(self) -> None:
        """Sum every rank's statistics (all ranks call this: it is a collective)."""
        parts = self.ranks.all_gather_object(self._own_part())
        self._gathered_adapt = adapt_across_ranks([p.adapt for p in parts if p.adapt is not None])
        self._gathered = merge_ranks(parts)

    def _own_part(self) -> RankPart:
        gen = self.generation
        return RankPart(gen.stats, gen.paired, gen.sample_log, self._cache_served(), self.likelihood.stats,
                        self.likelihood.samples, gen.adapt_summary(self.rank))

    def _plan(self, requests: list[Any]) -> list[PlannedRequest]:
        return plan_requests(requests, self.encode, self.tokenizer, self.adapter.info, self.args, self.base_seed,
                         self.sizes.pad_rows)

    # ---- pieces -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

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
