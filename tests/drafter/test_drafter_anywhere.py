"""A drafter for every target (issue 28): recording training data from ordinary runs, training from it (at one or
several block lengths), relative slot features, and the conf-tree fallback when no shipped drafter fits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from safetensors.torch import load_file

from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.model import DrafterMismatchError, load_drafter
from lm_eval_spot.drafter.recording import DrafterDataError
from lm_eval_spot.training.train import main as train_main
from lm_eval_spot.harness.model import SpotDLM

PROMPTS = ["Q: 3+4", "Q: 12+9", "Hi there", "Q: 7*8"]


def _reqs(kw: dict | None = None) -> list[Instance]:
    return [Instance("generate_until", {}, (c, {"until": ["\n\n"], "max_gen_toks": 20, **(kw or {})}), i)
            for i, c in enumerate(PROMPTS)]


def _records(folder: Path) -> dict[str, torch.Tensor]:
    """Every recorded shard of a folder, concatenated in file-name order (the reference reads the files itself)."""
    parts = [load_file(str(p)) for p in sorted(folder.glob("rec_*.safetensors"))]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def _per_request(rec: dict[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """(slot, token) commits of each recorded request, in order."""
    out: dict[int, list[tuple[int, int]]] = {}
    for s, p, t in zip(rec["sample_id"].tolist(), rec["pos"].tolist(), rec["tok"].tolist(), strict=True):
        out.setdefault(s, []).append((p, t))
    return [out[k] for k in sorted(out)]


def random_drafter_folder(folder: Path) -> Path:
    from lm_eval_spot.drafter.model import DrafterMeta, save_drafter

    torch.manual_seed(0)
    save_drafter(FactoredOrderModel(FactoredConfig()), DrafterMeta(2, 32, (8,), "tiny", "none"), folder)
    return folder


def test_a_control_run_records_what_collect_records(tiny_target_dir, tmp_path):
    """drafter_data on a plain control run stores the same trajectories as the dedicated collect step decodes."""
    from lm_eval_spot.training.train import collect

    lm = SpotDLM(pretrained=str(tiny_target_dir), mode="control", drafter_data=str(tmp_path / "rec"))
    lm.generate_until(_reqs())
    rec = _records(tmp_path / "rec")
    collect(tmp_path / "col", str(tiny_target_dir), PROMPTS, None, 20)
    col = load_file(str(next((tmp_path / "col" / "trajectories").glob("shard_*.safetensors"))))
    assert len(rec["pos"]) == len(col["pos"]) > 0
    for key in ("topk", "conf", "log1m", "top1", "committed", "eligible", "pos", "tok"):
        assert torch.equal(rec[key], col[key]), key
    # Independent of how both paths summarise: at T=0 control commits the most confident eligible slot and its
    # argmax token, so each record's own summary must say so at the slot it committed.
    rows = torch.arange(len(rec["pos"]))
    assert torch.equal(rec["top1"][rows, rec["pos"]].long(), rec["tok"])
    best = rec["conf"].masked_fill(~rec["eligible"], -1.0).amax(-1)
    assert torch.equal(rec["conf"][rows, rec["pos"]], best)
    meta = json.loads((tmp_path / "rec" / "collect.json").read_text())
    assert meta["block_len"] == 8
    summary = lm.generation.recording.summary()
    assert summary["commits"] == len(rec["pos"]) and summary["requests"] == len(PROMPTS)
    assert 0 < summary["seconds"] < lm.generation.decode_s  # recording's own time, a part of the decoding it rode on


@pytest.mark.parametrize("T,batch_size", [(0.0, 1), (1.0, 2)])
def test_a_spot_run_records_the_commits_control_made(tiny_target_dir, tmp_path, T, batch_size):
    """A drafting run records each verified commit: the same (slot, token) sequence per request as control's
    recording, at T=0 and T=1, one request at a time and batched."""
    kw = {"do_sample": True, "temperature": 1.0} if T else {}
    ctrl = SpotDLM(pretrained=str(tiny_target_dir), mode="control", seed=3, drafter_data=str(tmp_path / "c"))
    ctrl.generate_until(_reqs(kw))
    spot = SpotDLM(pretrained=str(tiny_target_dir), mode="spot", budget=4, seed=3, batch_size=batch_size,
                   drafter=str(random_drafter_folder(tmp_path / "d")), drafter_data=str(tmp_path / "s"))
    spot.generate_until(_reqs(kw))
    c, s = _records(tmp_path / "c"), _records(tmp_path / "s")
    assert _per_request(c) == _per_request(s)
    assert torch.equal(c["committed"], s["committed"]) and torch.equal(c["eligible"], s["eligible"])
    # Verification forwards carry several replicas: probabilities agree to float rounding, not bit for bit.
    torch.testing.assert_close(c["topk"].float(), s["topk"].float(), atol=2e-3, rtol=0)


def test_runs_append_and_the_trainer_reads_them_all(tiny_target_dir, tmp_path):
    folder = tmp_path / "rec"
    for _ in range(2):
        SpotDLM(pretrained=str(tiny_target_dir), mode="control", drafter_data=str(folder)).generate_until(_reqs())
    assert len(list(folder.glob("rec_*.safetensors"))) == 2
    from lm_eval_spot.training.train import load_trajectories

    t = load_trajectories(folder)
    assert int(t.sample_id.max()) + 1 == 2 * len(PROMPTS)  # each run's requests stay distinct samples
    starts = (t.block_id[1:] != t.block_id[:-1]).sum() + 1
    assert int(starts) == len(torch.unique(t.block_id))  # every block's rounds are contiguous and its id unique
    out = tmp_path / "d2"
    train_main(["train", "--data", str(folder), "--out", str(out), "--steps", "3", "--batch", "4", "--threads", "1",
                "--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64", "--d-pair", "16"])
    model, meta = load_drafter(out / "drafter", 8)
    assert meta.block_lens == (8,) and meta.extra["prompts"] == 2 * len(PROMPTS)


def test_a_folder_holds_one_block_length(tiny_target_dir, tmp_path):
    SpotDLM(pretrained=str(tiny_target_dir), mode="control", drafter_data=str(tmp_path)).generate_until(_reqs()[:1])
    with pytest.raises(DrafterDataError, match="holds records at block_len=8, this run decodes at block_len=4"):
        SpotDLM(pretrained=str(tiny_target_dir), mode="control", block_len=4, drafter_data=str(tmp_path))


def test_one_drafter_trains_across_block_lengths(tiny_target_dir, tmp_path):
    for L in (4, 8):
        lm = SpotDLM(pretrained=str(tiny_target_dir), mode="control", block_len=L, drafter_data=str(tmp_path / f"b{L}"))
        lm.generate_until(_reqs())
    out = tmp_path / "d"
    train_main(["train", "--data", str(tmp_path / "b4"), str(tmp_path / "b8"), "--out", str(out), "--steps", "4",
                "--batch", "4", "--threads", "1", "--d-model", "32", "--heads", "2", "--layers", "1", "--d-ff", "64",
                "--d-pair", "16", "--no-slot-embedding", "--relative-slots"])
    doc = json.loads((out / "drafter" / "drafter.json").read_text())
    assert doc["meta"]["block_lens"] == [4, 8] and doc["config"]["relative_slots"] is True
    assert set(doc["meta"]["extra"]["scores"]["by_block_len"]) == {"4", "8"}
    for L in (4, 8, 16):  # 16: never trained there, runs with a warning
        load_drafter(out / "drafter", L)


@pytest.mark.parametrize("L", [4, 16, 40])
def test_relative_slots_host_path_equals_torch_path(L):
    """The numpy drafting path computes the relative slot features like the torch one, at any block length."""
    from dataclasses import replace

    from helpers.summaries import view

    torch.manual_seed(5)
    model = FactoredOrderModel(FactoredConfig(slot_embedding=False, relative_slots=True)).eval()
    committed = torch.zeros(L, dtype=torch.bool)
    committed[:1] = True
    eligible = ~committed
    prep = model.prepare(view(torch.randn(L, 50) * 3), committed, eligible)
    maps = torch.zeros(3, L, dtype=torch.long)
    maps[1, L - 1] = 1
    maps[2, [1, 2]] = torch.tensor([1, 2])
    torch.testing.assert_close(model.node_probs(prep, maps), model.node_probs(replace(prep, host=None), maps),
                               atol=1e-6, rtol=1e-5)
    # The features move with the block length: the same slot reads differently in a block twice as long.
    rel = model.rel.weight @ torch.tensor([1.0 / max(1, L - 1), 0.0])
    assert rel.abs().sum() > 0


def test_no_fitting_default_drafter_falls_back_to_conf_tree(tiny_target_dir, caplog):
    """A target whose blocks are longer than any shipped drafter's slot tables still drafts (conf-tree), exactly,
    with one warning; a drafter the user names must fit."""
    with caplog.at_level(logging.WARNING):
        lm = SpotDLM(pretrained=str(tiny_target_dir), mode="spot", block_len=72, budget=4, control="paired", seed=2)
    from lm_eval_spot.settings.args import shipped_drafter_path

    shipped = (shipped_drafter_path("transfer") / "drafter.json").is_file()
    warned = [r.getMessage() for r in caplog.records if "drafting with conf-tree" in r.getMessage()]
    assert len(warned) == 1 and ("block_len=72" if shipped else "no drafter.json") in warned[0]
    assert lm.drafter_path is None
    lm.generate_until(_reqs()[:2])
    info = lm.get_model_info()["spot"]
    assert info["exact_match_to_control"] == 1.0 and info["drafter"] is None and "conf-tree" in info["drafter_note"]
    if shipped:
        with pytest.raises(DrafterMismatchError, match="block_len=72"):
            SpotDLM(pretrained=str(tiny_target_dir), mode="spot", block_len=72, drafter="transfer")


@pytest.mark.parametrize("block_len", [4, 8, 16])
def test_a_target_without_its_own_drafter_drafts_with_the_shipped_transfer_drafter(tiny_target_dir, block_len):
    from lm_eval_spot.settings.args import shipped_drafter_path

    if not (shipped_drafter_path("transfer") / "drafter.json").is_file():
        pytest.skip("the transfer drafter is not shipped in this checkout")
    lm = SpotDLM(pretrained=str(tiny_target_dir), mode="spot", block_len=block_len, control="paired", seed=4)
    assert lm.drafter_path is not None and lm.drafter_path.name == "spot-transfer-drafter"
    lm.generate_until(_reqs() + [Instance("generate_until", {}, ("Q: 5+5", {"until": ["\n\n"], "max_gen_toks": 20,
                                                                           "do_sample": True, "temperature": 1.0}), 9)])
    info = lm.get_model_info()["spot"]
    assert info["exact_match_to_control"] == 1.0 and info["drafter"] == "spot-transfer-drafter"
    assert info["nfe_per_sample"] < info["control_nfe_per_sample"]
