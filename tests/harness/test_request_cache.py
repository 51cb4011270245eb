"""lm-eval's --use_cache with spot-dlm, through lm-eval's own CachingLM: one file per configuration, hits counted."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.api.model import CachingLM
from sqlitedict import SqliteDict

from lm_eval_spot.harness.model import SpotDLM
from lm_eval_spot.reports.run_stats import format_summary
from lm_eval_spot.harness.request_cache import CacheConflictError


def _reqs(kw: dict | None = None) -> list[Instance]:
    kw = kw or {}
    return [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 12, **kw}), i)
            for i, c in enumerate(["Q: 1+2", "Q: 7-3", "Hi"])]


def _lm(tiny_target_dir, **kw) -> SpotDLM:
    return SpotDLM(pretrained=str(tiny_target_dir), mode=kw.pop("mode", "free-chain"), seed=kw.pop("seed", 1), **kw)


def test_a_rerun_is_served_from_the_cache_and_counted_apart_from_nfe(tiny_target_dir, tmp_path):
    db = str(tmp_path / "c.db")
    first = CachingLM(_lm(tiny_target_dir, budget=4), db)
    out1 = first.generate_until(_reqs())
    info1 = first.get_model_info()["spot"]
    assert info1["samples"] == 3 and info1["served_from_cache"] == 0 and info1["nfe_total"] > 0
    first.dbdict.close()

    again = CachingLM(_lm(tiny_target_dir, budget=4, batch_size=2), db)  # batch size changes speed, not ids
    assert again.generate_until(_reqs()) == out1
    info2 = again.get_model_info()["spot"]
    assert info2["served_from_cache"] == 3
    assert info2["samples"] == 0 and info2["nfe_total"] == 0  # nothing decoded, nothing counted
    # ... and no per-sample figure pretends otherwise: absent, not 0.0 ("free decoding")
    assert not {"nfe_per_sample", "tokens_per_forward", "gen_tokens_per_s", "nfe_median"} & set(info2)
    text = format_summary(info2)
    assert "no request was decoded: all 3 answers came from lm-eval's --use_cache cache" in text
    assert "NFE / sample" not in text

    # Sampled requests are never cached by lm-eval: they reach the model and are counted.
    sampled = again.generate_until(_reqs({"do_sample": True, "temperature": 1.0}))
    assert len(sampled) == 3
    assert again.get_model_info()["spot"]["samples"] == 3
    assert again.get_model_info()["spot"]["served_from_cache"] == 3
    assert "the figures above cover the 3 decoded requests only" in format_summary(again.get_model_info()["spot"])


@pytest.mark.parametrize("change,named", [({"mode": "control"}, "args.mode"), ({"budget": 8}, "args.budget"),
                                          ({"seed": 2}, "args.seed")])
def test_another_configuration_is_refused_before_anything_is_served(tiny_target_dir, tmp_path, change, named):
    db = str(tmp_path / "c.db")
    first = CachingLM(_lm(tiny_target_dir, budget=4), db)
    first.generate_until(_reqs()[:1])
    first.dbdict.close()
    with pytest.raises(CacheConflictError, match=f"another spot-dlm configuration \\({named}"):
        CachingLM(_lm(tiny_target_dir, **{"budget": 4, **change}), db)


def test_another_target_is_refused(tiny_target_dir, tmp_path):
    from helpers.tiny import save_tiny_target

    other = save_tiny_target(tmp_path / "other", seed=5, block_length=8)
    db = str(tmp_path / "c.db")
    CachingLM(_lm(tiny_target_dir), db).dbdict.close()
    with pytest.raises(CacheConflictError, match="target"):
        CachingLM(_lm(other), db)


def test_a_cache_written_by_another_model_is_refused(tiny_target_dir, tmp_path):
    db = str(tmp_path / "c.db")
    with SqliteDict(db, autocommit=True) as d:
        d["0" * 64] = "an answer from some other model"
    with pytest.raises(CacheConflictError, match="holds answers from another model"):
        CachingLM(_lm(tiny_target_dir), db)
