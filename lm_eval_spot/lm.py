"""The `spot-dlm` lm-eval model: generation through exact block-diffusion decoding, with NFE and speed counted."""

from __future__ import annotations

import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import LM
from tqdm import tqdm

from lm_eval_spot.baselines.oracle import CommitLog, OracleProposer
from lm_eval_spot.config import SpotArgs, parse_args
from lm_eval_spot.decoding.loop import DecodeConfig, DecodeResult, decode
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.decoding.proposer import Proposer
from lm_eval_spot.loading import load_target
from lm_eval_spot.methods import build_proposer
from lm_eval_spot.metrics import PairedStats, RunStats, SampleStats, format_summary
from lm_eval_spot.stopping import cut_text, make_stop_check

# A child of lm-eval's logger: its CLI shows these messages (run summary, load facts) with its own.
log = logging.getLogger("lm_eval.spot")

DEFAULT_MAX_GEN_TOKS = 256


@dataclass(frozen=True)
class _Job:
    context: str
    raw_kwargs: dict[str, Any]
    cfg: DecodeConfig
    until: list[str]
    seed: int


class SpotDLM(LM):
    """lm-eval model `spot-dlm`. Model args: see `lm_eval_spot.config.SpotArgs` and the README."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self.args: SpotArgs = parse_args(kwargs)  # raises before anything is loaded
        loaded = load_target(self.args)
        self.adapter = loaded.adapter
        self.tokenizer = loaded.tokenizer
        self.base_seed = self.args.seed if self.args.seed is not None else int(torch.initial_seed())
        self.oracle = self.args.mode == "oracle"
        self.proposer = build_proposer(self.args, self.adapter)
        drafting = self.args.mode != "control"
        self.stats = RunStats(mode=self.args.mode, budget=self.args.budget if drafting else None)
        # The oracle needs the control run of each request anyway: it is always paired.
        paired = drafting and (self.args.control == "paired" or self.oracle)
        self.paired = PairedStats() if paired else None
        if self.args.batch_size > 1:
            log.info("batch_size=%d: requests are decoded one at a time (NFE and exactness are per request)",
                     self.args.batch_size)

    # ---- lm-eval verbs ----------------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        raise NotImplementedError(
            "spot-dlm scores generation tasks only (output_type: generate_until, e.g. gsm8k, spot_arith); "
            "loglikelihood / multiple-choice tasks are not supported by diffusion decoding here"
        )

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        raise NotImplementedError(
            "spot-dlm scores generation tasks only (output_type: generate_until); "
            "loglikelihood_rolling (perplexity) tasks are not supported"
        )

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        # Every request is validated before the first one is decoded: nothing half-done on bad input.
        jobs = self._plan(requests)
        out: list[str] = []
        bar = tqdm(jobs, desc=f"spot-dlm [{self.args.mode}]", disable=disable_tqdm or self.rank != 0)
        for i, job in enumerate(bar):
            text, result = self._generate_job(job, control_first=i % 2 == 1)
            out.append(text)
            self._record(result, job.cfg.temperature)
            self.cache_hook.add_partial("generate_until", (job.context, job.raw_kwargs), text)
            bar.set_postfix(nfe=f"{self.stats.nfe_mean:.1f}")
        if jobs:
            log.info("spot-dlm run summary\n%s", format_summary(self.get_model_info()["spot"]))
        return out

    def _generate_job(self, job: _Job, control_first: bool) -> tuple[str, DecodeResult]:
        """Decode one request; with paired control, also decode it draft-free (alternating which runs first,
        so machine drift cancels in the paired ratios)."""
        if self.paired is None:
            return self._generate_one(job.context, job.cfg, job.seed, job.until, self.proposer)
        if self.oracle:
            commits = CommitLog()
            control = self._generate_one(job.context, job.cfg, job.seed, job.until, None, commits)
            assert isinstance(self.args.budget, int)
            drafted = self._generate_one(
                job.context, job.cfg, job.seed, job.until, OracleProposer(commits, self.args.budget)
            )
            self.paired.add(drafted[1], control[1])
            return drafted
        runs = {}
        for use_proposer in (False, True) if control_first else (True, False):
            runs[use_proposer] = self._generate_one(
                job.context, job.cfg, job.seed, job.until, self.proposer if use_proposer else None
            )
        self.paired.add(runs[True][1], runs[False][1])
        return runs[True]

    def _plan(self, requests: list[Any]) -> list[_Job]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs

        seen: Counter[str] = Counter()
        jobs: list[_Job] = []
        for req in requests:
            context, raw_kwargs = req.args[0], req.args[1]
            kw = normalize_gen_kwargs(dict(raw_kwargs), default_max_gen_toks=DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kw.get("until"), eos=self.tokenizer.eos_token)
            max_toks = int(kw["max_gen_toks"])
            if self.args.gen_length is not None:
                max_toks = min(max_toks, self.args.gen_length)
            temperature = float(kw.get("temperature", 0.0)) if kw.get("do_sample") else 0.0
            cfg = DecodeConfig(max_gen_toks=max_toks, temperature=temperature)
            # Repeats of one request get distinct but reproducible seeds.
            seen[context] += 1
            jobs.append(_Job(context, raw_kwargs, cfg, until, mix_seed(self.base_seed, context, seen[context])))
        return jobs

    # ---- pieces -----------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode_ids(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _generate_one(
        self,
        context: str,
        cfg: DecodeConfig,
        seed: int,
        until: list[str],
        proposer: Proposer | None,
        observer: CommitLog | None = None,
    ) -> tuple[str, DecodeResult]:
        result = decode(
            self.adapter,
            self.encode(context),
            cfg,
            seed,
            stop_check=make_stop_check(self.decode_ids, until),
            proposer=proposer,
            observer=observer,
            verify=self.args.verify if proposer is not None else "coupled",
        )
        return cut_text(self.decode_ids(result.token_ids), until), result

    def _record(self, r: DecodeResult, temperature: float) -> None:
        acc = sum(r.accepted) / len(r.accepted) if r.accepted else 0.0
        self.stats.add(
            SampleStats(r.nfe.total, len(r.token_ids), r.committed, r.rounds, acc, r.wall_s, r.stop_reason),
            temperature,
        )

    # ---- lm-eval hooks -------------------------------------------------------------------------------
    def get_model_info(self) -> dict[str, Any]:
        summary = self.stats.summary()
        if self.paired is not None:
            summary.update(self.paired.summary())
        return {
            "spot": summary,
            "spot_args": {k: v for k, v in vars(self.args).items()},
        }

    @property
    def tokenizer_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]", "__", str(self.tokenizer.name_or_path))

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"spot-dlm: --apply_chat_template needs a tokenizer with a chat template; "
                f"{self.tokenizer.name_or_path!r} has none (pass tokenizer=<folder with a chat template>)"
            )
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )
