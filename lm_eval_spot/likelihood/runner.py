"""`loglikelihood` and `loglikelihood_rolling` for the `spot-dlm` model: requests in, (log p, is_greedy) out, the
run's likelihood statistics kept."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from lm_eval_spot.adapters.base import TargetAdapter, positions_needed
from lm_eval_spot.settings.args import SpotArgs, SpotUserError
from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.loop import DecodeConfig
from lm_eval_spot.decoding.noise import mix_seed
from lm_eval_spot.errors import preview
from lm_eval_spot.likelihood.harness import (LikelihoodStats, encode_pair, greedy_wanted, pair_seed,
                                             rolling_windows)
from lm_eval_spot.likelihood.scorer import Estimate, LikelihoodConfig, Pair, context_groups, score_pairs

log = logging.getLogger("lm_eval.spot")

DEFAULT_CONTEXT = 2048  # rolling windows when the checkpoint states no context length


class LikelihoodRequestError(SpotUserError):
    """A likelihood request the target cannot score as asked; raised before any forward."""


@dataclass(frozen=True)
class RunnerSetup:
    adapter: TargetAdapter
    encode: Callable[[str], list[int]]
    prefix_id: int  # conditions an empty context (lm-eval's end-of-text convention)
    base_seed: int
    batch_size: Callable[[], int]  # requests scored together (asked at each call: "auto" sizes it lazily)


class LikelihoodRunner:
    def __init__(self, setup: RunnerSetup, args: SpotArgs) -> None:
        self.setup = setup
        self.cfg = LikelihoodConfig(mc_num=args.mc_num, mc_batch=args.mc_batch, cfg=args.cfg)
        self.sharing = args.mask_sharing
        self.greedy = args.greedy
        self.stats = LikelihoodStats()
        self.samples: list[dict[str, Any]] = []  # per request, in lm-eval's order (per document for rolling)

    @property
    def settings(self) -> str:
        return (f"mc_num={self.cfg.mc_num}, mc_batch={self.cfg.mc_batch}, cfg={self.cfg.cfg}, "
                f"masks={self.sharing}")

    # ---- checks -------------------------------------------------------------------------------------------
    def _positions(self, ctx: int, cont: int) -> int:
        """Positions the bound's forwards occupy: whole blocks on block-causal targets (the decoder's layout),
        exactly [context ; continuation] on bidirectional ones (no trailing canvas)."""
        info = self.setup.adapter.info
        return positions_needed(info, ctx, cont) if info.grid_origin == "zero" else ctx + cont

    def _check(self, index: int, context: str, ctx: list[int], cont: list[int]) -> None:
        info = self.setup.adapter.info
        if not cont:
            raise LikelihoodRequestError(
                f"spot-dlm: likelihood request {index} (context ending {preview(context)}) has a continuation "
                "that encodes to no tokens; nothing was scored")
        need = self._positions(len(ctx), len(cont))
        if info.max_positions is not None and need > info.max_positions:
            raise LikelihoodRequestError(
                f"spot-dlm: likelihood request {index} (context ending {preview(context)}) needs {need} positions "
                f"({len(ctx)} context and {len(cont)} continuation tokens), more than the target's context of "
                f"{info.max_positions}; nothing was scored. Shorten the prompts (e.g. --num_fewshot)")

    def window_len(self) -> int:
        """Rolling windows' max_seq_len: context + continuation (at most max_seq_len + 1) fits the positions."""
        info = self.setup.adapter.info
        n = info.max_positions or DEFAULT_CONTEXT
        if info.grid_origin == "zero":
            n = n // info.block_len * info.block_len
        return max(1, n - 1)

    # ---- scoring ------------------------------------------------------------------------------------------
    def _score(self, pairs: Sequence[Pair], desc: str, disable_tqdm: bool,
               keys: Sequence[Any] | None = None) -> list[Estimate]:
        """keys: each pair's document; the pairs of one document and context share their prefix's forwards."""
        bar = tqdm(total=len(pairs), desc=desc, disable=disable_tqdm)
        ests = score_pairs(self.setup.adapter, pairs, self.cfg, self.setup.batch_size(),
                           on_done=lambda i, e: bar.update(1), groups=context_groups(pairs, keys))
        bar.close()
        return ests

    def _greedy_flags(self, pairs: Sequence[Pair], wanted: Sequence[bool]) -> list[bool]:
        """is_greedy: does exact greedy decoding (control, T = 0) of the context produce the continuation? One
        decode per (context, continuation length): choices of one length share it."""
        info = self.setup.adapter.info
        need: dict[tuple[tuple[int, ...], int], list[int]] = {}
        too_long = 0
        for i, (p, w) in enumerate(zip(pairs, wanted, strict=True)):
            if not w:
                continue
            n = len(p.continuation)
            if info.max_positions is not None and positions_needed(info, len(p.context), n) > info.max_positions:
                too_long += 1  # the decode's canvas would pass the context: no flag (False)
                continue
            need.setdefault((p.context, n), []).append(i)
        if too_long:
            log.warning("spot-dlm: %d greedy flag(s) not computed (the decode would pass the target's context of "
                        "%s positions): reported as False", too_long, info.max_positions)
        flags = [False] * len(pairs)
        if not need:
            return flags
        jobs = [DecodeRequest(list(ctx), DecodeConfig(max_gen_toks=n, temperature=0.0, lookahead=False),
                          mix_seed(self.setup.base_seed, "greedy", ctx, n)) for ctx, n in need]
        results = decode_many(self.setup.adapter, jobs, batch_size=self.setup.batch_size())
        for idx, r in zip(need.values(), results, strict=True):
            self.stats.greedy_forwards += r.nfe.total
            for i in idx:
                flags[i] = tuple(r.token_ids) == pairs[i].continuation
        return flags

    def loglikelihood(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        t0 = time.perf_counter()
        pairs: list[Pair] = []
        for i, req in enumerate(requests):
            context, continuation = req.args[0], req.args[1]
            ctx, cont = encode_pair(self.setup.encode, context, continuation, self.setup.prefix_id)
            self._check(i, context, ctx, cont)
            pairs.append(Pair(tuple(ctx), tuple(cont), pair_seed(self.setup.base_seed, ctx, cont, self.sharing)))
        keys = [(str(getattr(r, "task_name", None) or "loglikelihood"), getattr(r, "doc_id", i))
                for i, r in enumerate(requests)]
        ests = self._score(pairs, "spot-dlm [loglikelihood]", disable_tqdm, keys)
        wanted = greedy_wanted(keys, self.greedy)
        flags = self._greedy_flags(pairs, wanted)
        docs: dict[tuple[str, Any], list[Estimate]] = {}
        for (task, doc), p, e, w, g in zip(keys, pairs, ests, wanted, flags, strict=True):
            self.stats.add(task, e, len(p.continuation))
            t = self.stats.task(task)
            t.greedy += w
            t.greedy_true += g
            docs.setdefault((task, doc), []).append(e)
            self.samples.append(_sample(task, doc, e))
        for (task, _), group in docs.items():
            self.stats.add_docs(task, [group])
        self.stats.wall_s += time.perf_counter() - t0
        return [(e.logprob, g) for e, g in zip(ests, flags, strict=True)]

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[float]:
        t0 = time.perf_counter()
        pairs: list[Pair] = []
        owner: list[int] = []
        for i, req in enumerate(requests):
            text = req.args[0]
            tokens = self.setup.encode(text)
            if not tokens:
                raise LikelihoodRequestError(f"spot-dlm: rolling likelihood request {i} encodes to no tokens")
            for ctx, cont in rolling_windows(tokens, self.setup.prefix_id, self.window_len()):
                pairs.append(Pair(tuple(ctx), tuple(cont), pair_seed(self.setup.base_seed, ctx, cont, self.sharing)))
                owner.append(i)
        ests = self._score(pairs, "spot-dlm [loglikelihood_rolling]", disable_tqdm, owner)
        per_doc: list[list[tuple[Pair, Estimate]]] = [[] for _ in requests]
        for o, p, e in zip(owner, pairs, ests, strict=True):
            per_doc[o].append((p, e))
        out: list[float] = []
        for i, (req, parts) in enumerate(zip(requests, per_doc, strict=True)):
            total = Estimate(sum(e.logprob for _, e in parts),
                             sum(e.variance for _, e in parts) if all(not math.isnan(e.variance) for _, e in parts)
                             else math.nan,
                             all(e.exact for _, e in parts), sum(e.forwards for _, e in parts),
                             sum(e.rows for _, e in parts))
            task = str(getattr(req, "task_name", None) or "loglikelihood_rolling")
            self.stats.add(task, total, sum(len(p.continuation) for p, _ in parts))
            self.samples.append(_sample(task, getattr(req, "doc_id", i), total))
            out.append(total.logprob)
        self.stats.wall_s += time.perf_counter() - t0
        return out


def _sample(task: str, doc: Any, e: Estimate) -> dict[str, Any]:
    return {"task": task, "doc_id": doc, "logprob": e.logprob, "se": None if math.isnan(e.se) else e.se,
            "exact": e.exact, "nfe": e.forwards}
