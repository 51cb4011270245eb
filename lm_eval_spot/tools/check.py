"""Self-check of a target on the user's own hardware, with the user's own weights:

    python -m lm_eval_spot.tools.check --model_args pretrained=JetLM/SDAR-4B-Chat,card=sdar-4b-chat --device cuda

Same model-argument grammar as `lm_eval --model_args`. Rows (each pass / warn / fail / skip):
- cache == full recomputation: the adapter's cached block logits against one cache-free forward of the whole
  sequence (largest difference, argmax flips), on a real prompt, over the first blocks;
- pure: repeated calls on a state give identical logits (the shared prefix is untouched);
- batch-shape invariance: a state alone against the same state as one replica among R (largest difference,
  argmax flips); flips are a warning (set batch_invariant=true) since the exactness rows below decide;
- native vs remote (SDAR, with trust_remote_code=true): both implementations' logits on the same states;
- SPOT == control at T=0 and T=1 on a few prompts (generated ids identical);
- control == the official generation, where the family defines one;
- likelihood: the bound (exact mode) on a prompt's last tokens against brute-force enumeration through
  cache-free forwards.
A table on the terminal, a JSON file (--out), exit status 1 when any row fails.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from itertools import combinations
from math import comb
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.adapters.bidirectional import raw_positions
from lm_eval_spot.settings.args import SpotArgError, SpotArgs, SpotUserError
from lm_eval_spot.settings.cards import parse_model_args
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.families import load_target
from lm_eval_spot.families.common import LoadedTarget
from lm_eval_spot.likelihood.scorer import LikelihoodConfig, Pair, score_pairs

log = logging.getLogger("lm_eval.spot")

DEFAULT_PROMPTS = (
    "Q: 9-2+6-2+9\nA:",
    "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?\nAnswer:",
    "def square(x):\n    \"\"\"Return x squared.\"\"\"\n",
)
# Largest logit difference allowed, relative to the logits' own scale (max |logit|), per dtype.
REL_TOL = {torch.float32: 1e-4, torch.float64: 1e-6, torch.bfloat16: 4e-2, torch.float16: 1e-2}


@dataclass
class Row:
    name: str
    status: str  # pass / warn / fail / skip
    detail: str
    numbers: dict[str, Any] = field(default_factory=dict)


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Largest absolute difference and the number of positions whose argmax differs."""
    return (a - b).abs().max().item(), int((a.argmax(-1) != b.argmax(-1)).sum().item())


def _flip_margins(out: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """At each position whose argmax differs, the reference's margin between its top two logits."""
    flip = out.argmax(-1) != ref.argmax(-1)
    if not bool(flip.any()):
        return []
    top2 = ref.float().topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1])[flip].tolist()


def _tol(ref: torch.Tensor, dtype: torch.dtype) -> float:
    return REL_TOL.get(dtype, 1e-2) * max(1.0, ref.abs().max().item())


def _first_states(loaded: LoadedTarget, prompt: list[int]) -> tuple[Any, list[int], torch.Tensor]:
    ad = loaded.adapter
    L, mask = ad.info.block_len, ad.info.mask_id
    session, tail = ad.open(prompt, 3 * L)
    state = torch.tensor(tail + [mask] * (L - len(tail)), dtype=torch.long)
    return session, prompt[: len(prompt) - len(tail)], state


def check_cache(loaded: LoadedTarget, prompts: list[list[int]], blocks: int = 3) -> list[Row]:
    ad = loaded.adapter
    if getattr(ad, "full_logits", None) is None and not hasattr(ad, "protocol"):
        return [Row("cache == full recomputation", "skip", "the adapter has no cache-free reference")]
    # An argmax flip where the reference's top two logits are closer than the dtype's tolerance is a near-tie that
    # rounding alone can decide (a warning, with its margin); a flip past that margin is a cache error.
    worst, flips, worst_tol, pure_ok = 0.0, 0, 0.0, True
    near_ties: list[float] = []
    for prompt in prompts:
        session, prefix, state = _first_states(loaded, prompt)
        # Block-causal adapters recompute [prefix ; state]; a bidirectional session recomputes its whole canvas.
        full = getattr(session, "full_logits", None) or (lambda st, p=prefix: ad.full_logits(p, st))
        for _ in range(blocks):
            got = session.block_logits(state[None])
            # The block's state as decoding finds it (all masks but the prompt's tail), then half filled with the
            # target's own argmax tokens: a cache must hold for states that differ from the one that built it.
            half = state.clone()
            masked = (half == ad.info.mask_id).nonzero().flatten()
            half[masked[::2]] = got[0].argmax(-1)[masked[::2]]
            for st in (state, half):
                out = session.block_logits(st[None])
                # A block's first call also writes pending blocks; later calls may take another kernel path.
                again = session.block_logits(st[None])
                pure_ok &= bool(torch.equal(again, session.block_logits(st[None])))
                ref = full(st[None])
                tol = _tol(ref, ad.dtype)
                for o in ((got, out, again) if st is state else (out, again)):
                    d, _ = _diff(o, ref)
                    margins = _flip_margins(o, ref)
                    near_ties += [m / tol for m in margins if m < tol]
                    worst, flips = max(worst, d), flips + sum(m >= tol for m in margins)
                    worst_tol = max(worst_tol, d / tol)
            done = state.clone()
            masked = done == ad.info.mask_id
            done[masked] = got[0].argmax(-1)[masked]  # fill the block with the target's own argmax tokens
            session.commit_block(done)
            prefix = prefix + done.tolist()
            full = getattr(session, "full_logits", None) or (lambda st, p=prefix: ad.full_logits(p, st))
            state = torch.full_like(state, ad.info.mask_id)
    ok = flips == 0 and worst_tol <= 1.0
    detail = (f"largest logit difference {worst:.3g} ({worst_tol:.2f} of the {ad.dtype} tolerance), "
              f"{flips} argmax flips, {len(prompts)} prompts x {blocks} blocks")
    status = "pass" if ok else "fail"
    if near_ties:
        detail += (f"; {len(near_ties)} flips at near-ties (top-two margin {min(near_ties):.2f}-{max(near_ties):.2f} "
                   f"of the tolerance: rounding decides them)")
        status = "warn" if ok else status
    if ad.info.grid_origin == "prompt_end" and ad.info.exact_prefix_cache:
        detail += " (exact mode caches nothing: every forward recomputes the whole canvas)"
    if not ad.info.exact_prefix_cache:  # approximate by design: measured, reported, not a failure
        status, detail = "warn", detail + " (approximate prefix cache: not lossless against full recomputation)"
    rows = [Row("cache == full recomputation", status, detail,
                {"max_abs_diff": worst, "argmax_flips": flips, "of_tolerance": worst_tol,
                 "near_tie_flips": len(near_ties), "near_tie_margins_of_tolerance": near_ties})]
    rows.append(Row("pure (prefix unchanged by replica forwards)", "pass" if pure_ok else "fail",
                    "repeated calls identical" if pure_ok else "repeated calls on one state differ"))
    return rows


def check_invariance(loaded: LoadedTarget, prompt: list[int], sizes: tuple[int, ...] = (2, 9, 21)) -> Row:
    ad = loaded.adapter
    session, _, state = _first_states(loaded, prompt)
    alone = session.block_logits(state[None])
    alone = session.block_logits(state[None])  # after the block's first call (which writes the prefix)
    gen = torch.Generator().manual_seed(0)
    numbers: dict[str, Any] = {}
    flips_total = 0
    for R in sizes:
        others = state.expand(R - 1, -1).clone()
        fill = torch.randint(0, ad.info.vocab_size, others.shape, generator=gen)
        others = torch.where(torch.rand(others.shape, generator=gen) < 0.5, fill, others)
        d, f = _diff(session.block_logits(torch.cat([state[None], others]))[:1], alone)
        numbers[f"R={R}"] = {"max_abs_diff": d, "argmax_flips": f}
        flips_total += f
    detail = "largest logit difference, argmax flips: " + ", ".join(
        f"{k} {v['max_abs_diff']:.3g}, {v['argmax_flips']}" for k, v in numbers.items())
    if flips_total:
        return Row("batch-shape invariance", "warn", detail + " (argmax flips: run with batch_invariant=true)", numbers)
    return Row("batch-shape invariance", "pass", detail, numbers)


def check_native_vs_remote(args: SpotArgs, loaded: LoadedTarget, prompt: list[int]) -> Row:
    from lm_eval_spot.families import by_name

    if len(by_name(loaded.family).impls) < 2:
        return Row("native vs remote", "skip", f"family {loaded.family} has one implementation")
    if not args.trust_remote_code:
        return Row("native vs remote", "skip", "pass trust_remote_code=true to compare with the official code")
    try:
        other = load_target(replace(args, impl="remote" if loaded.impl == "native" else "native", cache="none"))
    except SpotUserError as err:  # the other implementation cannot be built here: check what can be
        return Row("native vs remote", "skip", f"the other implementation does not load: {err}")
    s1, _, state = _first_states(loaded, prompt)
    s2, _, _ = _first_states(other, prompt)
    a, b = s1.block_logits(state[None]), s2.block_logits(state[None])
    d, f = _diff(a, b)
    a2, b2 = s1.block_logits(state[None]), s2.block_logits(state[None])  # past the block's first call
    d2, f2 = _diff(a2, b2)
    d, f = max(d, d2), f + f2
    ok = f == 0 and d <= _tol(b, loaded.adapter.dtype)
    del other
    return Row("native vs remote", "pass" if ok else "fail", f"largest logit difference {d:.3g}, {f} argmax flips",
               {"max_abs_diff": d, "argmax_flips": f})


def _proposer(args: SpotArgs, loaded: LoadedTarget) -> tuple[Any, str]:
    from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
    from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
    from lm_eval_spot.settings.proposers import build_proposer

    budget = args.budget if isinstance(args.budget, int) else 8
    try:
        choice = build_proposer(replace(args, mode="spot", budget=budget), loaded.adapter)
        if choice.drafter is None:  # the run would fall back to conf-tree: check the learned path regardless
            raise ValueError(choice.note)
        return choice.proposer, f"drafter {choice.drafter.name}, budget {budget}"
    except (SpotArgError, ValueError) as err:
        torch.manual_seed(0)  # exactness holds for any drafter: a random-weight one stands in
        model = FactoredOrderModel(FactoredConfig()).to(loaded.adapter.device)
        log.info("self-check: %s", err)
        return TreeProposer(LearnedOrder(model), TreeConfig(budget=budget)), (
            f"random-weight drafter: none loads for block_len={loaded.adapter.info.block_len}; budget {budget}")


def check_exactness(args: SpotArgs, loaded: LoadedTarget, prompts: list[list[int]], max_toks: int) -> list[Row]:
    proposer, what = _proposer(args, loaded)
    rows = []
    for T in (0.0, 1.0):
        cfg = DecodeConfig(max_gen_toks=max_toks, temperature=T, lookahead=args.lookahead)  # as runs decode
        same, nfe_c, nfe_s, first_diff = 0, 0, 0, None
        for i, prompt in enumerate(prompts):
            c = decode(loaded.adapter, prompt, cfg, seed=i)
            s = decode(loaded.adapter, prompt, cfg, seed=i, proposer=proposer)
            nfe_c, nfe_s = nfe_c + c.nfe.total, nfe_s + s.nfe.total
            if s.token_ids == c.token_ids:
                same += 1
            elif first_diff is None:
                first_diff = next((j for j, (x, y) in enumerate(zip(s.token_ids, c.token_ids)) if x != y),
                                  min(len(s.token_ids), len(c.token_ids)))
        ok = same == len(prompts)
        detail = (f"{same}/{len(prompts)} generations identical, NFE {nfe_c} -> {nfe_s} ({what})"
                  + ("" if ok else f"; first difference at token {first_diff}"))
        rows.append(Row(f"SPOT == control, T={T:g}", "pass" if ok else "fail", detail,
                        {"identical": same, "n": len(prompts), "nfe_control": nfe_c, "nfe_spot": nfe_s}))
    return rows


def check_official(loaded: LoadedTarget, prompts: list[list[int]]) -> Row:
    from lm_eval_spot.families import by_name

    hook = getattr(by_name(loaded.family).module, "official_control", None)
    if hook is None:
        return Row("control == official generation", "skip", f"not defined for family {loaded.family}")
    result = hook(loaded, prompts)
    if isinstance(result, str):
        return Row("control == official generation", "skip", result)
    same, n = result
    return Row("control == official generation", "pass" if same == n else "fail",
               f"{same}/{n} generations identical at T=0", {"identical": same, "n": n})


def _enumerated_bound(loaded: LoadedTarget, ctx: list[int], cont: list[int]) -> float:
    """The likelihood bound by brute force: every mask pattern of every unit through a cache-free forward
    (`full_logits` of whole blocks, or whole sequences on bidirectional targets)."""
    ad = loaded.adapter
    info = ad.info
    L, mask = info.block_len, info.mask_id
    seq = ctx + cont
    if info.grid_origin == "zero":
        units = [(b * L, [i for i in range(b * L, min(len(seq), (b + 1) * L)) if i >= len(ctx)])
                 for b in range(len(ctx) // L, -(-len(seq) // L))]
    else:
        units = [(0, list(range(len(ctx), len(seq))))]
    total = 0.0
    for start, positions in units:
        k = len(positions)
        for n in range(1, k + 1):
            acc = 0.0
            for S in combinations(positions, n):
                ids = [mask if i in S else t for i, t in enumerate(seq)]
                if info.grid_origin == "zero":
                    block = ids[start : start + L] + [mask] * max(0, start + L - len(ids))
                    logits = ad.full_logits(ids[:start], torch.tensor([block]))[0]  # type: ignore[attr-defined]
                    at = [i - start for i in S]
                else:
                    shifted = bool(getattr(getattr(ad, "protocol", None), "shifted", False))
                    keep = raw_positions(len(ctx), k, shifted)
                    logits = ad.sequence_logits(torch.tensor([ids]), keep)[0]  # type: ignore[attr-defined]
                    at = [i - len(ctx) for i in S]
                logp = torch.log_softmax(logits.double(), dim=-1)
                acc += sum(float(logp[j, seq[i]]) for j, i in zip(at, S, strict=True))
            total += acc / (n * comb(k, n))
    return total


def check_likelihood(loaded: LoadedTarget, prompt: list[int]) -> Row:
    """The likelihood bound (exact mode, as multiple-choice tasks use it) against brute-force enumeration through
    cache-free forwards: on a block-causal target this checks the prefix cache and the forked sessions."""
    name = "likelihood bound == cache-free enumeration"
    if len(prompt) < 5:
        return Row(name, "skip", "the prompt is too short")
    ctx, cont = prompt[:-3], prompt[-3:]
    ad = loaded.adapter
    got = score_pairs(ad, [Pair(tuple(ctx), tuple(cont), 0), Pair(tuple(ctx), tuple(cont[:1]), 0)],
                      LikelihoodConfig(mc_num=7))
    ref = [_enumerated_bound(loaded, ctx, cont), _enumerated_bound(loaded, ctx, cont[:1])]
    diff = max(abs(g.logprob - r) for g, r in zip(got, ref, strict=True))
    tol = REL_TOL.get(ad.dtype, 1e-2) * max(1.0, *(abs(r) for r in ref))
    ok = diff <= tol and all(g.exact for g in got)
    return Row(name, "pass" if ok else "fail",
               f"log p of the prompt's last 3 tokens {got[0].logprob:.4f} (enumerated {ref[0]:.4f}); of the first "
               f"of them {got[1].logprob:.4f} ({ref[1]:.4f}); largest difference {diff:.2e} (tolerance {tol:.1e})",
               {"bound": [g.logprob for g in got], "enumerated": ref, "max_diff": diff})


def run_checks(args: SpotArgs, prompts_text: list[str], max_toks: int) -> tuple[dict[str, Any], list[Row]]:
    loaded = load_target(args)
    tok = loaded.tokenizer
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts_text]
    info = loaded.adapter.info
    target = {"pretrained": args.pretrained, "family": loaded.family, "impl": loaded.impl, "block_len": info.block_len,
              "mask_id": info.mask_id, "stop_ids": sorted(info.stop_ids), "dtype": str(loaded.adapter.dtype),
              "device": str(loaded.adapter.device), "prefix_cache": "exact" if info.exact_prefix_cache else "approximate"}
    rows = check_cache(loaded, prompts)
    rows.append(check_invariance(loaded, prompts[0]))
    rows.append(check_native_vs_remote(args, loaded, prompts[0]))
    rows += check_exactness(args, loaded, prompts, max_toks)
    rows.append(check_official(loaded, prompts))
    rows.append(check_likelihood(loaded, prompts[0]))
    return target, rows


def format_table(target: dict[str, Any], rows: list[Row]) -> str:
    head = ", ".join(f"{k}={v}" for k, v in target.items())
    w = max(len(r.name) for r in rows)
    lines = [f"spot-dlm self-check: {head}", "", f"| {'check':<{w}} | result | detail |", f"|{'-' * (w + 2)}|--------|--------|"]
    lines += [f"| {r.name:<{w}} | {r.status.upper():<6} | {r.detail} |" for r in rows]
    failed = [r.name for r in rows if r.status == "fail"]
    lines += ["", "FAILED: " + "; ".join(failed) if failed else "all checks passed"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from lm_eval.utils import simple_parse_args_string

    ap = argparse.ArgumentParser(prog="python -m lm_eval_spot.tools.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model_args", default="", help="as for lm_eval: pretrained=...,card=...,impl=...")
    ap.add_argument("--device", default=None, help="overrides device= in --model_args")
    ap.add_argument("--prompt", action="append", help="a prompt text (repeatable); default: three built-in prompts")
    ap.add_argument("--max-gen-toks", type=int, default=48, help="tokens generated per prompt in the exactness rows")
    ap.add_argument("--out", type=Path, default=Path("spot_check.json"), help="JSON file with every row")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    raw = simple_parse_args_string(a.model_args) if a.model_args else {}
    if a.device:
        raw["device"] = a.device
    try:
        args = parse_model_args(raw)
        target, rows = run_checks(args, a.prompt or list(DEFAULT_PROMPTS), a.max_gen_toks)
    except SpotUserError as err:
        print(str(err), file=sys.stderr)
        return 2
    print(format_table(target, rows))
    passed = not any(r.status == "fail" for r in rows)
    a.out.write_text(json.dumps({"target": target, "passed": passed, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"\nwritten: {a.out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
