"""Measure what common random masks do to a multiple-choice decision: the variance, over seeds, of the score
difference between a question's correct choice and each wrong one (and between two wrong ones), with masks shared
across a question's choices ("common") and drawn per choice ("independent"), on spot_arith_mc and the embedded
target.

    python -m lm_eval_spot.likelihood.variance --docs 25 --seeds 12 --mc-num 32 \\
        --out docs/results/likelihood_variance.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.settings.args import parse_args
from lm_eval_spot.families import load_target
from lm_eval_spot.likelihood.harness import encode_pair, pair_seed
from lm_eval_spot.likelihood.scorer import LikelihoodConfig, Pair, score_pairs
from lm_eval_spot.harness.registration import tasks_dir

log = logging.getLogger(__name__)


def mc_docs(n: int) -> list[dict[str, Any]]:
    """The task's own documents (its loader in the plugin's task folder)."""
    spec = importlib.util.spec_from_file_location("spot_arith_utils", tasks_dir() / "spot_arith" / "utils.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.mc_docs(n)


def measure(docs: list[dict[str, Any]], seeds: int, mc_num: int, sharing: str, batch_size: int) -> dict[str, Any]:
    loaded = load_target(parse_args({"mode": "control"}))
    tok = loaded.tokenizer

    def encode(s: str) -> list[int]:
        return tok(s, add_special_tokens=False)["input_ids"]

    cfg = LikelihoodConfig(mc_num=mc_num)
    diffs: dict[tuple[int, int], list[float]] = {}
    wdiffs: dict[tuple[int, int, int], list[float]] = {}
    golds: dict[int, list[float]] = {}
    correct, ses, t0 = [], [], time.perf_counter()
    for s in range(seeds):
        pairs, where = [], []
        for d, doc in enumerate(docs):
            context = f"Q: {doc['question']}\nA:"
            for c, choice in enumerate(doc["choices"]):
                ctx, cont = encode_pair(encode, context, choice, 0)
                pairs.append(Pair(tuple(ctx), tuple(cont), pair_seed(s, ctx, cont, sharing)))
                where.append((d, c))
        ests = score_pairs(loaded.adapter, pairs, cfg, batch_size)
        scores: dict[int, dict[int, float]] = {}
        for (d, c), e in zip(where, ests, strict=True):
            scores.setdefault(d, {})[c] = e.logprob
            ses.append(e.se)
        for d, doc in enumerate(docs):
            gold = int(doc["gold"])
            golds.setdefault(d, []).append(scores[d][gold])
            best = max(scores[d], key=lambda c: scores[d][c])
            correct.append(best == gold)
            for c, v in scores[d].items():
                if c != gold:
                    diffs.setdefault((d, c), []).append(scores[d][gold] - v)
            wrong = sorted(c for c in scores[d] if c != gold)
            for a, b in zip(wrong, wrong[1:]):  # between two wrong choices (both estimates uncertain)
                wdiffs.setdefault((d, a, b), []).append(scores[d][a] - scores[d][b])
        log.info("%s: seed %d of %d done (%.0f s)", sharing, s + 1, seeds, time.perf_counter() - t0)
    var = [statistics.variance(v) for v in diffs.values()]
    wvar = [statistics.variance(v) for v in wdiffs.values()]
    return {"sharing": sharing, "mean_var_of_difference": statistics.mean(var),
            "median_var_of_difference": statistics.median(var),
            "mean_var_wrong_vs_wrong": statistics.mean(wvar), "median_var_wrong_vs_wrong": statistics.median(wvar),
            "mean_var_correct_alone": statistics.mean(statistics.variance(v) for v in golds.values()),
            "accuracy": sum(correct) / len(correct),
            "mean_reported_se": statistics.mean(ses), "pairs": len(diffs), "wall_s": time.perf_counter() - t0}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=25)
    ap.add_argument("--seeds", type=int, default=12)
    ap.add_argument("--mc-num", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if a.threads:
        torch.set_num_threads(a.threads)
    docs = mc_docs(a.docs)
    rows = [measure(docs, a.seeds, a.mc_num, sharing, a.batch_size) for sharing in ("common", "independent")]
    out = {"command": f"python -m lm_eval_spot.likelihood.variance --docs {a.docs} --seeds {a.seeds} "
                      f"--mc-num {a.mc_num}", "docs": a.docs, "seeds": a.seeds, "mc_num": a.mc_num, "rows": rows,
           "variance_ratio_common_over_independent":
               rows[0]["mean_var_of_difference"] / rows[1]["mean_var_of_difference"],
           "variance_ratio_wrong_vs_wrong": rows[0]["mean_var_wrong_vs_wrong"] / rows[1]["mean_var_wrong_vs_wrong"]}
    text = json.dumps(out, indent=2)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)  # noqa: T201 - a command line's result


if __name__ == "__main__":
    main()
