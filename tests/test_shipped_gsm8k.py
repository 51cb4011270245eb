"""The shipped English target (`pretrained=spot-gsm8k`, issue 53 item 6): found by name with its own drafter, its
defaults read from its files on first contact, a prompt as long as lm-eval's default 5-shot gsm8k one decoded,
and SPOT equal to paired control on it; the stock `gsm8k` task through the real CLI where ../shared/data is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_eval.api.instance import Instance

from lm_eval_spot.harness.model import SpotDLM
from lm_eval_spot.settings.args import drafter_for, parse_args, shipped_target_path

from helpers.cli import run_cli

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TARGET = shipped_target_path("spot-gsm8k")

# Worked examples written for this test (not GSM8K's), in lm-eval's gsm8k few-shot layout: with a question, a prompt
# past the embedded target's whole context of 512 tokens (lm-eval's 5-shot gsm8k prompts: 514-1,456 here, median 900).
SHOTS = [
    ("A baker made 24 rolls in the morning and 18 in the afternoon. He sold 30 of them. How many rolls are left?",
     "He made 24 + 18 = <<24+18=42>>42 rolls.\nAfter selling 30 he has 42 - 30 = <<42-30=12>>12 rolls left.\n#### 12"),
    ("Maria reads 15 pages a day. How many pages does she read in 2 weeks?",
     "Two weeks are 2 * 7 = <<2*7=14>>14 days.\nShe reads 15 * 14 = <<15*14=210>>210 pages.\n#### 210"),
    ("A box holds 6 eggs. How many boxes are needed for 50 eggs if every box must be full except the last?",
     "50 / 6 = 8 with 2 left over, so 8 full boxes and 1 more box.\nThat is 8 + 1 = <<8+1=9>>9 boxes.\n#### 9"),
    ("Tom had $40. He bought 3 books at $7 each and a pen for $2. How much money does he have now?",
     "The books cost 3 * 7 = $<<3*7=21>>21.\nHe spent 21 + 2 = $<<21+2=23>>23.\nHe has 40 - 23 = $<<40-23=17>>17 "
     "left.\n#### 17"),
    ("A train travels 60 miles per hour for 3 hours and then 45 miles per hour for 2 hours. How far does it go?",
     "First it goes 60 * 3 = <<60*3=180>>180 miles.\nThen it goes 45 * 2 = <<45*2=90>>90 miles.\nIn all it goes "
     "180 + 90 = <<180+90=270>>270 miles.\n#### 270"),
    ("A school orders 12 packs of pencils with 10 pencils in each pack and 8 packs of pens with 6 pens in each pack. "
     "Each of the 30 students gets the same number of pencils. How many pencils does each student get, and how many "
     "pens does the school have?",
     "The school has 12 * 10 = <<12*10=120>>120 pencils.\nEach student gets 120 / 30 = <<120/30=4>>4 pencils.\nThe "
     "school has 8 * 6 = <<8*6=48>>48 pens.\nThe question asks for the pencils each student gets.\n#### 4"),
    ("Lena saves $15 every week for 6 weeks. Then she spends a third of her savings on a jacket and half of what is "
     "left on shoes. How much money does she have left at the end?",
     "She saves 15 * 6 = $<<15*6=90>>90.\nThe jacket costs 90 / 3 = $<<90/3=30>>30, leaving 90 - 30 = "
     "$<<90-30=60>>60.\nThe shoes cost 60 / 2 = $<<60/2=30>>30, leaving 60 - 30 = $<<60-30=30>>30.\n#### 30"),
]
QUESTIONS = [
    "Sam has 5 bags with 12 marbles in each bag. He gives away 17 marbles. How many marbles does he have left?",
    "A farmer plants 8 rows of corn with 25 plants in each row. Rabbits eat 30 plants. How many plants remain?",
]


def prompt(question: str) -> str:
    head = "".join(f"Question: {q}\nAnswer: {a}\n\n" for q, a in SHOTS)
    return head + f"Question: {question}\nAnswer:"


def requests(**gen) -> list[Instance]:
    kw = {"until": ["Question:", "</s>", "<|im_end|>"], "max_gen_toks": 256, **gen}  # lm-eval's gsm8k stops
    return [Instance("generate_until", {}, (prompt(q), dict(kw)), i) for i, q in enumerate(QUESTIONS)]


def test_found_by_name_with_its_own_drafter_and_small_enough_to_ship():
    args = parse_args({"pretrained": "spot-gsm8k"})
    assert Path(args.pretrained) == TARGET
    assert drafter_for(args).name == "spot-gsm8k-drafter"
    assert (drafter_for(args) / "drafter.json").is_file()
    weights = sum(f.stat().st_size for f in TARGET.iterdir())
    assert weights <= 10.5e6, weights  # the issue's ~10 MB
    cfg = json.loads((TARGET / "config.json").read_text())
    assert cfg["max_position_embeddings"] >= 1712  # the longest 5-shot gsm8k test prompt (1,456 tokens) + 256


def test_first_contact_reads_its_defaults_and_decodes_a_five_shot_prompt():
    lm = SpotDLM(pretrained="spot-gsm8k", mode="control")
    tok = lm.tokenizer
    assert len(tok(prompt(QUESTIONS[0]), add_special_tokens=False)["input_ids"]) > 512
    target = lm.get_model_info()["spot_target"]
    assert target["block_len"] == 4
    assert target["mask_id"] == tok.mask_token_id and tok.eos_token_id in target["stop_ids"]
    out = lm.generate_until(requests())
    assert all(o.strip() for o in out), out  # it writes something: a worked answer, in English


@pytest.mark.parametrize("gen", [{}, {"do_sample": True, "temperature": 1.0}])
def test_spot_equals_paired_control_on_it(gen):
    lm = SpotDLM(pretrained="spot-gsm8k", control="paired", seed=1234)
    lm.generate_until(requests(**gen))
    info = lm.get_model_info()["spot"]
    assert info["exact_match_to_control"] == 1.0
    assert info["nfe_per_sample"] < info["control_nfe_per_sample"]  # its drafter saves forwards


@pytest.mark.slow
@pytest.mark.skipif(not DATA.is_dir(), reason="../shared/data is absent")
def test_stock_gsm8k_five_shot_through_the_cli(tmp_path):
    """The issue's command, cut to 3 problems: lm-eval's own gsm8k task, its default 5 shots, offline."""
    proc = run_cli(["--model", "spot-dlm", "--model_args", "pretrained=spot-gsm8k,control=paired", "--tasks", "gsm8k",
                    "--limit", "3", "--device", "cpu", "--output_path", str(tmp_path)], cwd=DATA)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert res["n-shot"]["gsm8k"] == 5
    assert res["config"]["spot"]["exact_match_to_control"] == 1.0
