"""The natural-language target recipe: corpora read as lm-eval formats them, a BPE tokenizer that encodes any text,
packed few-shot sequences, and a trained text target that the plugin runs on first contact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from research import text_corpus as tc

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
needs_data = pytest.mark.skipif(not (SHARED_DATA / "openai" / "gsm8k").is_dir(),
                                reason="../shared/data (real GSM8K, ARC) absent")


def test_a_packed_sequence_is_lm_eval_s_few_shot_prompt_followed_by_the_answer():
    shots = [tc.Example("Question: a?\nAnswer:", " one"), tc.Example("Question: b?\nAnswer:", " two")]
    ex = tc.Example("Question: c?\nAnswer:", " three")
    # lm-eval: each shot is doc_to_text + target_delimiter + target, joined by the few-shot delimiter "\n\n"
    expected_prompt = "Question: a?\nAnswer: one\n\nQuestion: b?\nAnswer: two\n\nQuestion: c?\nAnswer:"
    assert tc.pack(ex, shots) == (expected_prompt, " three")
    assert tc.pack(ex, []) == ("Question: c?\nAnswer:", " three")


def test_the_bpe_tokenizer_encodes_any_text_and_the_loss_regions_follow_the_recipe():
    texts = ["Question: how many apples?\nAnswer: 3 + 4 = <<3+4=7>>7\n#### 7"] * 50
    tok = tc.train_bpe(texts, 300)
    assert len(tok) <= 300 and tok.mask_token == tc.MASK and tok.eos_token == tc.EOS == tok.pad_token
    for s in ("Ünïcödé – never seen ✓", "Question: 12 × 4?\n\n", texts[0]):
        assert tok.decode(tok.encode(s, add_special_tokens=False)) == s
    assert tok.mask_token_id not in tok.encode(texts[0] + " <mask> [MASK]", add_special_tokens=False)
    shot, ex = tc.Example("Question: a?\nAnswer:", " 1"), tc.Example("Question: b?\nAnswer:", " 2")
    ids, p = tc.encode_packed(tok, ex, [shot], "answer")
    assert ids[-1] == tok.eos_token_id and tok.decode(ids[p:-1]) == " 2"
    ids2, p2 = tc.encode_packed(tok, ex, [shot], "first_answer")
    assert ids2 == ids and tok.decode(ids2[:p2]) == "Question: a?\nAnswer:"
    with pytest.raises(ValueError, match="loss_from"):
        tc.encode_packed(tok, ex, [], "all")


def test_corpus_specs_read_jsonl_fields_and_text_paragraphs_and_name_what_is_accepted(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"q": "Hi?", "a": "Yes."}\n\n{"q": "Two?", "a": "No."}\n')
    (tmp_path / "t.txt").write_text("First paragraph.\n\nSecond\nparagraph.\n\n\n")
    got = tc.load_corpus(f"{tmp_path / 'd.jsonl'}:q:a,{tmp_path / 't.txt'}")
    assert got == [tc.Example("Hi?", " Yes."), tc.Example("Two?", " No."), tc.Example("", "First paragraph."),
                   tc.Example("", "Second\nparagraph.")]
    with pytest.raises(ValueError, match="no field 'x'"):
        tc.load_corpus(f"{tmp_path / 'd.jsonl'}:x:a")
    with pytest.raises(ValueError, match="accepted: gsm8k"):
        tc.load_corpus("wikitext")
    train, held = tc.split_holdout(got, 2, seed=3)
    assert len(held) == 2 and len(train) == 2 and not set(map(id, train)) & set(map(id, held))


@needs_data
def test_named_corpora_are_train_splits_formatted_as_lm_eval_s_tasks():
    gsm = tc.load_corpus("gsm8k", SHARED_DATA)
    assert len(gsm) == 7473  # GSM8K's train split; its test split is what lm-eval's gsm8k reads
    test_q = {json.loads(x)["question"] for x in (SHARED_DATA / "openai/gsm8k/main/test.jsonl").read_text().splitlines()}
    assert not any(e.prompt.removeprefix("Question: ").removesuffix("\nAnswer:") in test_q for e in gsm)
    assert gsm[0].prompt.startswith("Question: Natalia") and gsm[0].prompt.endswith("\nAnswer:")
    assert gsm[0].answer.startswith(" ") and gsm[0].answer.endswith("#### 72")
    arc = tc.load_corpus("arc_easy", SHARED_DATA)
    row = json.loads((SHARED_DATA / "allenai/ai2_arc/ARC-Easy/train.jsonl").read_text().splitlines()[0])
    right = row["choices"]["text"][row["choices"]["label"].index(row["answerKey"])]
    assert arc[0] == tc.Example(f"Question: {row['question']}\nAnswer:", f" {right}")


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_a_text_target_trains_resumes_and_runs_in_the_plugin_with_its_own_defaults(tmp_path, attention):
    """A few steps of the recipe on a small question / answer corpus; the checkpoint then loads in `spot-dlm` with
    no argument but its path: mask id, eos and block length from its files; SPOT's output equals control's."""
    from research.train_text_target import main
    from lm_eval.api.instance import Instance

    from lm_eval_spot.harness.model import SpotDLM

    corpus = tmp_path / "qa.jsonl"
    corpus.write_text("".join(json.dumps({"q": f"Question: What is {a} plus {b}?\nAnswer:",
                                          "a": f"{a} plus {b} is {a + b}."}) + "\n"
                              for a in range(8) for b in range(8)))
    out = tmp_path / "nl"
    args = ["--out", str(out), "--corpus", f"{corpus}:q:a", "--steps", "4", "--warmup", "2", "--hidden", "32", "--layers", "1", "--heads", "2",
            "--kv-heads", "2", "--batch", "4", "--val-every", "2", "--holdout", "6", "--samples", "1",
            "--max-new", "16", "--block-len", "4", "--tokenizer", "bpe:600", "--threads", "1",
            "--attention", attention, "--max-positions", "512"]
    assert main([*args, "--stop-after", "2"]) == 0 and not (out / "final").exists()
    first_tok = (out / "tokenizer" / "tokenizer.json").read_text()
    assert main(args) == 0  # resumes from step 2 with the same tokenizer
    assert (out / "tokenizer" / "tokenizer.json").read_text() == first_tok
    ev = json.loads((out / "eval.json").read_text())
    assert ev["steps"] == 4 and ev["heldout_loss_per_token"] > 0 and len(ev["samples"]) == 1
    assert 258 < ev["vocab_size"] <= 600  # bytes, specials and the merges this small corpus allows
    texts = {}
    for mode in ("control", "spot"):
        lm = SpotDLM(pretrained=str(out / "final"), mode=mode, budget=4, seed=0)
        assert lm.adapter.info.block_len == 4 and lm.tokenizer.mask_token_id == lm.adapter.info.mask_id
        assert lm.tokenizer.eos_token_id in lm.adapter.info.stop_ids
        req = Instance("generate_until", {}, ("Question: Tom has 3 apples.\nAnswer:",
                                              {"until": ["Question:"], "max_gen_toks": 12}), 0)
        texts[mode] = lm.generate_until([req])
    assert texts["spot"] == texts["control"]


def test_a_bidirectional_recipe_skips_held_out_answers_longer_than_its_canvas(tmp_path):
    """Training draws only answers that fit --max-new; the held-out checks skip the others alike (a GSM8K answer
    of 167 tokens stopped a run with --max-new 160 at its first check)."""
    from research.train_text_target import main

    corpus = tmp_path / "qa.jsonl"
    long = " then".join(f" add {k}" for k in range(30))
    corpus.write_text("".join(json.dumps({"q": f"Question: sum {a}?\nAnswer:", "a": (long if a % 2 else f" {a}.")})
                              + "\n" for a in range(40)))
    out = tmp_path / "bi"
    assert main(["--out", str(out), "--corpus", f"{corpus}:q:a", "--steps", "2", "--warmup", "1", "--hidden", "32",
                 "--layers", "1", "--heads", "2", "--kv-heads", "2", "--batch", "4", "--val-every", "1",
                 "--holdout", "12", "--samples", "1", "--max-new", "16", "--block-len", "4", "--tokenizer", "bpe:300",
                 "--threads", "1", "--attention", "bidirectional", "--max-positions", "128"]) == 0
    assert json.loads((out / "eval.json").read_text())["heldout_loss_per_token"] > 0


@needs_data
@pytest.mark.slow
def test_cli_pairs_runs_the_stock_gsm8k_task_offline_on_a_text_target(tmp_path):
    """The measurement driver on lm-eval's stock gsm8k (zero-shot, from ../shared/data): control and the default
    through the lm_eval CLI, generations compared, speed ratio written."""
    from research.cli_pairs import main as pairs
    from research.train_text_target import main as train

    out = tmp_path / "nl"
    assert train(["--out", str(out), "--steps", "3", "--warmup", "1", "--hidden", "32", "--layers", "1", "--heads",
                  "2", "--kv-heads", "2", "--batch", "2", "--val-every", "0", "--holdout", "4", "--samples", "0",
                  "--max-new", "16", "--block-len", "4", "--tokenizer", "bpe:512", "--threads", "1"]) == 0
    res = tmp_path / "pairs"
    pairs(["--task", "gsm8k", "--num-fewshot", "0", "--data-dir", str(SHARED_DATA), "--limit", "2", "--sizes", "1",
           "--temps", "0", "--repeats", "1", "--threads", "1", "--target", f"nl={out / 'final'}:12", "--out", str(res)])
    rows = json.loads((res / "results.json").read_text())
    assert [r["config"] for r in rows] == ["mode=control", "default"]
    assert all(r["identical_to_control"] == "2/2" for r in rows) and rows[0]["nfe_per_sample"] == 12
    assert "--tasks gsm8k" in rows[1]["command"] and "--num_fewshot 0" in rows[1]["command"]
