"""The `spot-dlm` model's wiring, in one function: arguments -> the target, its proposer and policy, and the two
runners (generation and likelihood) that own lm-eval's calls."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.budget import MAX_BUDGET
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.drafter.online import online_adapter_for
from lm_eval_spot.drafter.recording import DrafterDataWriter
from lm_eval_spot.families import load_target
from lm_eval_spot.families.common import with_concrete_dtype
from lm_eval_spot.harness.batch_size import BatchSizes
from lm_eval_spot.harness.distributed import Ranks, detect_ranks, rank_device
from lm_eval_spot.harness.generation import GenerationRunner, GenerationSetup
from lm_eval_spot.likelihood.runner import LikelihoodRunner, RunnerSetup
from lm_eval_spot.reports.run_stats import PairedStats, RunStats
from lm_eval_spot.settings.args import SpotArgs, shipped_drafter_path
from lm_eval_spot.settings.proposers import ProposerChoice, build_proposer
from lm_eval_spot.settings.threads import ThreadPolicy, choose_threads, default_thread_counts
from lm_eval_spot.tokens import TextDecoder

log = logging.getLogger("lm_eval.spot")


@dataclass
class ModelParts:
    """What a `spot-dlm` instance runs on."""

    args: SpotArgs  # the device resolved for this rank, dtype=auto resolved to the dtype it names
    ranks: Ranks
    adapter: Any  # TargetAdapter
    tokenizer: Any
    text: TextDecoder
    threads: ThreadPolicy
    target: dict[str, Any]  # the results' `spot_target`
    base_seed: int
    choice: ProposerChoice  # the proposer, its drafter and budget=auto's policy
    sizes: BatchSizes
    generation: GenerationRunner
    likelihood: LikelihoodRunner


def build_parts(args: SpotArgs) -> ModelParts:
    """Load the target and assemble everything around it (the arguments are already validated)."""
    ranks = detect_ranks(args.device)
    if rank_device(args.device, ranks) != args.device:
        args = replace(args, device=rank_device(args.device, ranks))
    # dtype=auto becomes the dtype it names on this device: the summary, the results and the request cache's
    # fingerprint all read the resolved one.
    args = with_concrete_dtype(args)
    loaded = load_target(args)
    adapter, tokenizer = loaded.adapter, loaded.tokenizer
    info = adapter.info
    text = TextDecoder.for_target(tokenizer, info.vocab_size)
    model = getattr(adapter, "model", None)  # the foreign model the adapter wraps (none for some adapters)
    n_params = sum(p.numel() for p in model.parameters()) if model is not None else None
    threads = choose_threads(args.threads, torch.device(adapter.device).type, n_params, os.environ,
                             torch.get_num_threads(), default_thread_counts())
    log.info("spot-dlm: threads: %s", threads.reason)
    target = {"family": loaded.family, "impl": loaded.impl, "card": args.card, "block_len": info.block_len,
              "mask_id": info.mask_id, "stop_ids": sorted(info.stop_ids), "dtype": args.dtype}
    base_seed = args.seed if args.seed is not None else int(torch.initial_seed())
    choice = build_proposer(args, adapter)
    if choice.drafter is not None and choice.drafter.resolve() == shipped_drafter_path("transfer").resolve():
        log.info("spot-dlm: mode=%s drafts with the shipped transfer drafter (trained on tiny targets, not on %s): "
                 "outputs stay exact; a drafter trained on this target accepts more drafts: add drafter_data=FOLDER "
                 "to any run (control included), then python -m lm_eval_spot.training train --data FOLDER --out D",
                 args.mode, args.pretrained)
    recording = (DrafterDataWriter(Path(args.drafter_data), args.pretrained, info.block_len, info.mask_id, ranks.rank)
                 if args.drafter_data else None)
    online = online_adapter_for(args, choice.proposer, choice.drafter,
                                mix_seed(base_seed, "adapt", ranks.rank) & 0xFFFFFFFF)
    drafting = args.mode != "control"
    stats = RunStats(mode=args.mode, budget=args.budget if drafting else None,
                     exact_prefix_cache=info.exact_prefix_cache, batch_size=args.batch_size)
    # Proposers that read each request's control decode (the oracle) need it run anyway: always paired.
    paired = drafting and (args.control == "paired" or choice.requests.reads_control)
    drafter_out = Path(args.drafter_out).expanduser() if args.drafter_out else None
    generation = GenerationRunner(
        GenerationSetup(adapter, args, choice.requests, text, recording, online, choice.policy, drafter_out,
                        f"rank_{ranks.rank}" if ranks.distributed else None, choice.canvas),
        stats, PairedStats() if paired else None)
    sizes = BatchSizes(adapter, args.batch_size, args.batch_invariant, drafting, args.budget, MAX_BUDGET,
                       args.mc_batch, args.max_batch_size)

    def encode(s: str) -> list[int]:
        return tokenizer(s, add_special_tokens=False)["input_ids"]

    prefix = tokenizer.eos_token_id
    likelihood = LikelihoodRunner(
        RunnerSetup(adapter, encode, int(prefix if prefix is not None else info.mask_id), base_seed,
                    sizes.likelihood), args)
    if args.batch_invariant and args.batch_size not in (1, "auto"):
        log.info("batch_invariant=true: requests are decoded one at a time (batch_size=%s ignored)", args.batch_size)
    return ModelParts(args, ranks, adapter, tokenizer, text, threads, target, base_seed, choice, sizes, generation,
                      likelihood)
