"""Issue 25: every card's default command on a checkpoint built from the REAL hub files (tests/helpers/real_files.py: the
published config with one layer and narrow widths, the hub's weight names, sharding and tokenizer files), through
the real CLI on the stock gsm8k task with --apply_chat_template: control at the card's own block length, SPOT at
T=0 and T=1 at the card's own block length with its default drafter (SDAR's block 4 included, issue 28) with the
draft-free decode of every request in the same process (control=paired) to compare with, every SDAR block
variant (8 ... 64) the same way in process, and the self-check. Runs are cut to two problems, zero-shot, 64
generated tokens. Slow: about 20 CLI runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.real_files import FAMILY, REAL, build, hub_names, reduced_config
from helpers.cli import LM_EVAL

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
CARDS = {"sdar-1.7b-chat": "sdar-1.7b-chat", "sdar-4b-chat": "sdar-4b-chat", "sdar-8b-chat": "sdar-8b-chat",
         "llada-8b-instruct": "llada-8b-instruct", "dream-v0-instruct-7b": "dream-v0-instruct-7b"}
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1"}
pytestmark = pytest.mark.skipif(not REAL.is_dir(), reason="../shared/real_checkpoints is absent (it is in CI)")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return {name: build(name, root / name, layers=1) for name in CARDS}


@pytest.mark.parametrize("name", list(CARDS))
def test_weight_names_and_shards_are_the_hubs(ckpts, name):
    folder = ckpts[name]
    hub = hub_names(name, 1)
    if hub is None:  # SDAR-1.7B-Chat ships one model.safetensors
        assert (folder / "model.safetensors").is_file()
        return
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == hub and len(set(index.values())) > 1
    cfg = json.loads((folder / "config.json").read_text())
    real = json.loads((REAL / name / "config.json").read_text())
    assert set(cfg) == set(real)  # every published field is there (only sizes changed)
    assert cfg == reduced_config(name, 1)


def _cli(args: list[str], out: Path) -> dict:
    proc = subprocess.run([LM_EVAL, "--model", "spot-dlm", *args, "--tasks", "gsm8k", "--limit", "2",
                           "--num_fewshot", "0", "--apply_chat_template", "--device", "cpu", "--log_samples",
                           "--output_path", str(out)], capture_output=True, text=True, cwd=DATA, env=ENV, timeout=1200)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-3000:]
    data = json.loads(next(out.rglob("results_*.json")).read_text())
    data["_samples"] = [json.loads(x) for x in next(out.rglob("samples_gsm8k_*.jsonl")).read_text().splitlines()]
    data["_log"] = log
    return data


def _tokenizer(folder: Path, name: str):
    from transformers import AutoTokenizer, Qwen2TokenizerFast

    # Dream's hub tokenizer class is remote code (not staged); it reads the same files as transformers' Qwen2 one.
    return Qwen2TokenizerFast.from_pretrained(folder) if FAMILY[name] == "dream" else AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CARDS))
def test_card_default_command_runs_gsm8k_in_control_and_spot(ckpts, name, tmp_path):
    if not (DATA / "openai" / "gsm8k").exists():
        pytest.skip("../shared/data has no gsm8k")
    folder, card = ckpts[name], CARDS[name]
    gen = "max_gen_toks=64"
    control = _cli(["--model_args", f"card={card},pretrained={folder},mode=control", "--gen_kwargs", gen],
                   tmp_path / "control")
    spot_card = card
    tok = _tokenizer(folder, name)
    for run in [control]:
        for s in run["_samples"]:  # the prompt is the template's own rendering of the question
            user = f"Question: {s['doc']['question']}\nAnswer:"
            assert s["arguments"]["gen_args_0"]["arg_0"] == tok.apply_chat_template(
                [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
    assert control["chat_template_sha"] is not None
    stops = set(control["config"]["spot_target"]["stop_ids"])
    end_of_turn = {"sdar": 151645, "dream": 151645, "llada": 126348}[FAMILY[name]]
    assert end_of_turn in stops and tok.convert_tokens_to_ids(tok.eos_token) in stops
    # T = 0: the card's default budget (auto: drafts only where it pays, so NFE may equal control's on a CPU whose
    # forward grows with its rows); T = 1 with a fixed budget, so the drafting itself is exercised on every family.
    for T, extra, budget in ((0, gen, ""), (1, gen + ",temperature=1.0,do_sample=true", ",budget=8")):
        spot = _cli(["--model_args", f"card={spot_card},pretrained={folder},control=paired{budget}", "--gen_kwargs",
                     extra], tmp_path / f"spot_T{T}")
        s = spot["config"]["spot"]
        assert s["mode"] == "spot" and s["temperature"] == T and s["samples"] == 2
        assert s["exact_match_to_control"] == 1.0, s
        if budget:
            assert s["nfe_per_sample"] < s["control_nfe_per_sample"]
        else:
            assert s["budget"] == "auto" and s["budget_policy"]["startup_s"] > 0, s
            assert s["nfe_per_sample"] <= s["control_nfe_per_sample"]
        assert s["drafter"] == "spot-transfer-drafter", s  # the card's drafter: the shipped transfer one
        if T == 0 and spot_card == card:  # the same command in control, in another process, wrote the same text
            assert [x["resps"] for x in spot["_samples"]] == [x["resps"] for x in control["_samples"]]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["", "-b8", "-b16", "-b32", "-b64"])
def test_every_sdar_block_variant_runs_spot_exactly(ckpts, variant):
    """SDAR's card and each block variant, default mode and drafter: SPOT == control at T=0 and T=1 (at a fixed
    budget, so every variant drafts: budget=auto may choose control's rounds where the rows cost too much)."""
    from lm_eval.api.instance import Instance

    from lm_eval_spot.harness.model import SpotDLM

    lm = SpotDLM(card="sdar-1.7b-chat" + variant, pretrained=str(ckpts["sdar-1.7b-chat"]), control="paired",
                 dtype="float32", seed=5, budget=8)
    assert lm.adapter.info.block_len == {"": 4, "-b8": 8, "-b16": 16, "-b32": 32, "-b64": 64}[variant]
    assert lm.drafter_path is not None and lm.drafter_path.name == "spot-transfer-drafter"
    reqs = [Instance("generate_until", {}, (q, {"until": ["<|im_end|>"], "max_gen_toks": 40, **kw}), i)
            for i, (q, kw) in enumerate([("What is 2+3?", {}), ("Name a colour.", {}),
                                         ("What is 7+8?", {"do_sample": True, "temperature": 1.0}),
                                         ("Say hi.", {"do_sample": True, "temperature": 1.0})])]
    lm.generate_until(reqs)
    s = lm.get_model_info()["spot"]
    assert s["exact_match_to_control"] == 1.0 and s["samples"] == 4, s
    assert s["nfe_per_sample"] < s["control_nfe_per_sample"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CARDS))
def test_self_check_passes_with_the_card(ckpts, name, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lm_eval_spot.tools.check", "--model_args",
                           f"card={CARDS[name]},pretrained={ckpts[name]}", "--device", "cpu", "--max-gen-toks", "16",
                           "--out", str(tmp_path / "c.json")], capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads((tmp_path / "c.json").read_text())["passed"] is True
