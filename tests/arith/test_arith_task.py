"""The spot_arith task, its tokenizer, the lm-eval task folder and the target training loop (CPU, < 30 s)."""

from __future__ import annotations

import json
import random
import re
import statistics
from pathlib import Path

import pytest
import torch

from lm_eval_spot.arith import generator as gen
from lm_eval_spot.arith.tokenizer import MAX_NUMBER_TOKEN, build_tokenizer, check_round_trip, save_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TASK_DIR = ROOT / "tasks" / "spot_arith"
ASSET_DIR = ROOT / "lm_eval_spot" / "assets" / "spot-arith-target"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def test_docs():
    return gen.make_split("test", gen.TEST_SIZE)


# ------------------------------------------------------------------------------------------------ generator


def test_make_problem_is_deterministic():
    a = [gen.make_problem(random.Random(5)) for _ in range(3)]
    b = [gen.make_problem(random.Random(5)) for _ in range(3)]
    assert a == b
    assert gen.make_split("train", 30) == gen.make_split("train", 30)


def test_problem_invariants():
    rng = random.Random(0)
    for _ in range(2000):
        p = gen.make_problem(rng)
        nums = [int(x) for x in re.findall(r"\d+", p["question"])]
        assert gen.MIN_OPS + 1 <= len(nums) <= gen.MAX_OPS + 1
        assert all(gen.MIN_OPERAND <= x <= gen.MAX_OPERAND for x in nums)
        assert eval(p["question"]) == p["final"]  # noqa: S307 -- digits and +/- only
        for a, op, b, c in re.findall(r"Step \d+: (\d+) ([+-]) (\d+) = (\d+)", p["answer"]):
            assert 0 <= int(c) <= gen.MAX_TOTAL
            assert int(c) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert p["answer"].endswith(f"#### {p['final']}")
        assert gen.final_from_answer(p["answer"]) == str(p["final"])


def test_shipped_test_split_is_reproduced_byte_for_byte(test_docs, tmp_path):
    shipped = (TASK_DIR / "spot_arith_test.jsonl").read_bytes()
    out = tmp_path / "test.jsonl"
    gen.write_split_jsonl(out, test_docs)
    assert out.read_bytes() == shipped
    assert len(test_docs) == gen.TEST_SIZE == len({d["question"] for d in test_docs})


def test_train_and_val_never_contain_test_questions(test_docs):
    test_q = {d["question"] for d in test_docs}
    assert not test_q & {d["question"] for d in gen.make_split("train", 3000)}
    assert not test_q & {d["question"] for d in gen.make_split("val", 200)}
    stream = gen.iter_problems(random.Random(gen.TEST_SEED), exclude=test_q)  # same seed as test: all filtered
    assert not test_q & {next(stream)["question"] for _ in range(200)}


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_numbers(tok, test_docs):
    texts = [gen.make_prompt(d["question"]) + d["answer"] for d in test_docs]
    texts += ["Hello, World! 250 1999 007 -3.5 $12\t{x}\n", "Q: 1+2\nA:<|endoftext|>"]
    assert check_round_trip(tok, texts) == []
    for n in range(MAX_NUMBER_TOKEN + 1):
        assert len(tok.encode(str(n), add_special_tokens=False)) == 1
    assert tok.unk_token_id not in tok.encode("".join(texts), add_special_tokens=False)


def test_tokenizer_special_ids_after_save_and_load(tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    save_tokenizer(tmp_path)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    for t in (AutoTokenizer.from_pretrained(tmp_path), fast):
        assert t.convert_tokens_to_ids(["<|endoftext|>", "<|mask|>", "<unk>"]) == [0, 1, 2]
    t = AutoTokenizer.from_pretrained(tmp_path)
    assert (t.eos_token_id, t.pad_token_id, t.mask_token_id, t.unk_token_id, t.bos_token_id) == (0, 0, 1, 2, None)
    ids = t("Q: 1+2\nA:")["input_ids"]
    assert ids == t.encode("Q: 1+2\nA:", add_special_tokens=False)  # no BOS/EOS added
    assert t.decode(ids) == "Q: 1+2\nA:"


def test_median_answer_spans_two_blocks(tok, test_docs):
    lengths = [len(tok.encode(d["answer"], add_special_tokens=False)) for d in test_docs]
    assert statistics.median(lengths) >= 64


# ------------------------------------------------------------------------------------------------ lm-eval task


def test_lm_eval_task_indexes_and_loads(test_docs):
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_defaults=False, include_path=str(ROOT / "tasks"))
    assert {"spot_arith", "spot_arith_mini"} <= set(tm.all_tasks)
    tasks = tm.load(["spot_arith", "spot_arith_mini"])["tasks"]
    full, mini = tasks["spot_arith"], tasks["spot_arith_mini"]
    docs = list(full.test_docs())
    assert len(docs) == gen.TEST_SIZE and len(list(mini.test_docs())) == 50
    assert full.doc_to_text(docs[0]) == gen.make_prompt(test_docs[0]["question"])
    assert full.doc_to_target(docs[0]) == test_docs[0]["answer"]
    assert full.config.generation_kwargs["until"] == ["Q:", "<|endoftext|>"]


# ------------------------------------------------------------------------------------------------ training


def _tiny_cfg(out: Path, **kw):
    from research.train_target import ModelConfig, TrainConfig

    base = dict(
        model=ModelConfig(hidden=32, layers=1, heads=2, kv_heads=2, max_positions=256),
        steps=4, batch=4, warmup=2, ckpt_every=2, log_every=2, val_every=0, eval_n=1, max_new=8, threads=1,
    )
    base.update(kw)
    return TrainConfig(out=str(out), **base)


def test_make_batch_masks_only_answer_positions(tok):
    from research.train_target import encode_problem, make_batch

    rng = random.Random(0)
    seqs = [encode_problem(tok, gen.make_problem(rng)) for _ in range(8)]
    b = make_batch(seqs, 32, tok.mask_token_id, tok.eos_token_id, 0.5, torch.Generator().manual_seed(0))
    B, T = b.labels.shape
    assert T % 32 == 0 and b.input_ids.shape == (B, 2 * T - 32)
    for i, (ids, p) in enumerate(seqs):
        assert not b.masked[i, :p].any()  # the prompt is never masked
        assert b.masked[i, p:].any()
        assert (b.labels[i, len(ids) :] == tok.eos_token_id).all()
    noisy = b.input_ids[:, T - 32 :]
    assert ((noisy == tok.mask_token_id) == b.masked).all()


def test_greedy_decode_stops_and_respects_budget(tok):
    from research.train_target import ModelConfig, build_model, greedy_decode

    torch.manual_seed(0)
    model = build_model(ModelConfig(hidden=32, layers=1, heads=2, kv_heads=2), tok, 32).eval()
    prompt = tok.encode("Q: 1+2+3+4+5\nA:", add_special_tokens=False)
    out = greedy_decode(model, prompt, 32, tok.mask_token_id, tok.eos_token_id, max_new=40)
    assert len(out) <= 40 and tok.eos_token_id not in out and tok.mask_token_id not in out


def test_training_smoke_checkpoint_and_resume(tmp_path):
    from transformers import AutoModelForCausalLM

    from research.train_target import CHECKPOINT, load_checkpoint, train

    straight = train(_tiny_cfg(tmp_path / "a"))
    assert straight == tmp_path / "a" / "final"
    # Interrupted after 2 steps, then rerun with the same --out: resumes from the checkpoint.
    assert train(_tiny_cfg(tmp_path / "b", stop_after=2)) == tmp_path / "b"
    assert load_checkpoint(tmp_path / "b" / CHECKPOINT)["step"] == 2
    resumed = train(_tiny_cfg(tmp_path / "b"))
    assert load_checkpoint(tmp_path / "b" / CHECKPOINT)["step"] == 4

    sa = load_checkpoint(tmp_path / "a" / CHECKPOINT)["model"]
    sb = load_checkpoint(tmp_path / "b" / CHECKPOINT)["model"]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)  # resume continues the exact same run

    model = AutoModelForCausalLM.from_pretrained(resumed)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.block_length == 32
    assert (resumed / "model.safetensors").exists() and (resumed / "tokenizer.json").exists()
    ev = json.loads((tmp_path / "b" / "eval.json").read_text())
    assert ev["n"] == 1 and 0.0 <= ev["exact_match"] <= 1.0


# ------------------------------------------------------------------------------------------------ shipped target


@pytest.mark.skipif(not (ASSET_DIR / "config.json").exists(), reason="trained target not shipped yet")
def test_shipped_target_matches_tokenizer_and_block_length(tok):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(ASSET_DIR)
    assert cfg.model_type == "qwen3" and cfg.block_length == 32 and cfg.tie_word_embeddings
    shipped = AutoTokenizer.from_pretrained(ASSET_DIR)
    assert shipped.get_vocab() == tok.get_vocab() and cfg.vocab_size == len(tok)
    assert (ASSET_DIR / "model.safetensors").stat().st_size <= 20 * 2**20
