"""Text corpora for natural-language targets: examples read from JSONL or plain text, a BPE tokenizer trained on
them, and the training stream of `research.train_text_target` (packed multi-example sequences).

An example is a prompt and an answer. The named corpora are the TRAIN splits `../shared/data` stages, formatted as
lm-eval's stock tasks format their documents, so that a target trained here meets lm-eval's prompts in
distribution: `gsm8k` ("Question: {question}\\nAnswer:" and " {answer}", GSM8K's worked solutions ending
"#### N"), `arc_easy` / `arc_challenge` ("Question: {question}\\nAnswer:" and " {the right choice's text}"). No split
a benchmark reads is ever trained on: gsm8k's test split and ARC's validation and test splits are never opened.

A packed sequence is up to `max_shots` other examples, each "prompt answer", joined by "\\n\\n" (lm-eval's few-shot
delimiter), then the example's own prompt and answer and eos: lm-eval's k-shot prompt followed by its answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
MASK = "<|mask|>"
FEWSHOT_DELIMITER = "\n\n"  # lm-eval's default between few-shot examples
DEFAULT_SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@dataclass(frozen=True)
class Example:
    prompt: str  # what the model is given ("Question: ...\nAnswer:")
    answer: str  # what it learns to write after it (" ..."; the eos is added by the encoder)


def _gsm8k(row: dict[str, Any]) -> Example:
    return Example(f"Question: {row['question']}\nAnswer:", f" {row['answer']}")


def _arc(row: dict[str, Any]) -> Example:
    choices = row["choices"]
    text = choices["text"][choices["label"].index(row["answerKey"])]
    return Example(f"Question: {row['question']}\nAnswer:", f" {text}")


# name -> (file under the shared data folder, formatter). Train splits only (see the module docstring).
NAMED: dict[str, tuple[str, Any]] = {
    "gsm8k": ("openai/gsm8k/main/train.jsonl", _gsm8k),
    "arc_easy": ("allenai/ai2_arc/ARC-Easy/train.jsonl", _arc),
    "arc_challenge": ("allenai/ai2_arc/ARC-Challenge/train.jsonl", _arc),
}


def read_jsonl(path: Path, prompt_field: str | None, answer_field: str,
               prompt_template: str = "{prompt}", answer_template: str = " {answer}") -> list[Example]:
    """Examples from a JSONL file's named fields (prompt_field None: no prompt; the answer is the whole text)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for f in (prompt_field, answer_field):
            if f is not None and f not in row:
                raise ValueError(f"{path}:{n}: no field {f!r}; fields: {', '.join(row)}")
        prompt = prompt_template.format(prompt=row[prompt_field]) if prompt_field else ""
        out.append(Example(prompt, answer_template.format(answer=row[answer_field]) if prompt_field
                           else str(row[answer_field])))
    return out


def read_text(path: Path) -> list[Example]:
    """Examples from plain text: one per paragraph (blank-line separated), no prompt."""
    paras = [p.strip() for p in path.read_text().split("\n\n")]
    return [Example("", p) for p in paras if p]


def load_corpus(spec: str, shared: Path = DEFAULT_SHARED) -> list[Example]:
    """`spec`: comma-separated parts, each a name in NAMED, a `.txt` file, or `FILE.jsonl:PROMPT_FIELD:ANSWER_FIELD`
    (PROMPT_FIELD may be empty)."""
    out: list[Example] = []
    for part in (p.strip() for p in spec.split(",")):
        if part in NAMED:
            rel, fmt = NAMED[part]
            path = shared / rel
            if not path.is_file():
                raise FileNotFoundError(f"corpus {part!r} reads {path}, which is missing (is ../shared/data there?)")
            out += [fmt(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
        elif part.endswith(".txt"):
            out += read_text(Path(part))
        elif ".jsonl:" in part:
            file, prompt_field, answer_field = part.rsplit(":", 2)
            out += read_jsonl(Path(file), prompt_field or None, answer_field)
        else:
            raise ValueError(f"corpus part {part!r}: accepted: {', '.join(NAMED)}, a .txt file, or "
                             "FILE.jsonl:PROMPT_FIELD:ANSWER_FIELD")
    if not out:
        raise ValueError(f"corpus {spec!r} holds no example")
    return out


def split_holdout(examples: Sequence[Example], n: int, seed: int) -> tuple[list[Example], list[Example]]:
    """(train, held out): `n` examples drawn with `seed` are kept out of training (held-out loss, samples)."""
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    held = set(idx[:n])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


def train_bpe(texts: Iterable[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on `texts` (any string encodes, nothing is unknown), wrapped as a
    transformers PreTrainedTokenizerFast: eos = pad = <|endoftext|>, mask = <|mask|>, no BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, mask_token=MASK)


def load_tokenizer(folder: str) -> Any:
    """An existing tokenizer folder (e.g. a real checkpoint's): it must name a mask token or hold <|mask|>;
    its eos is the sequence end."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.mask_token is None:
        if MASK not in tok.get_vocab():
            tok.add_special_tokens({"mask_token": MASK})
        else:
            tok.mask_token = MASK
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer in {folder} has no eos token")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def pack(example: Example, shots: Sequence[Example]) -> tuple[str, str]:
    """(prompt, answer) of a packed sequence: the shots in lm-eval's few-shot layout, then the example."""
    head = "".join(s.prompt + s.answer + FEWSHOT_DELIMITER for s in shots)
    return head + example.prompt, example.answer


def encode_packed(tok: Any, example: Example, shots: Sequence[Example], loss_from: str) -> tuple[list[int], int]:
    """(ids with eos, where the loss region starts). loss_from="answer": only the example's own answer (what a
    fully bidirectional canvas generates); "first_answer": everything after the first prompt (the shots' answers
    and later questions too: more text learned per sequence, for block-causal targets)."""
    prompt, answer = pack(example, shots)
    ids_p = tok.encode(prompt, add_special_tokens=False)
    ids_a = tok.encode(answer, add_special_tokens=False)
    ids = ids_p + ids_a + [tok.eos_token_id]
    if loss_from == "answer":
        return ids, len(ids_p)
    if loss_from == "first_answer":
        first = shots[0] if shots else example
        return ids, len(tok.encode(first.prompt, add_special_tokens=False))
    raise ValueError(f"loss_from must be answer or first_answer, got {loss_from!r}")


def prompts_file(examples: Sequence[Example], n: int, max_shots: int, seed: int, out: Path) -> int:
    """A JSONL prompts file (`{"prompt": ...}` per line, what `python -m lm_eval_spot.training --prompts-file`
    reads): the first n examples' prompts, each after 0..max_shots other examples in lm-eval's few-shot layout (so
    a drafter meets the long few-shot contexts its target is run on). Returns the count written."""
    rng = random.Random(seed)
    pool = list(examples[: n + 64])
    rows = []
    for i, ex in enumerate(examples[:n]):
        shots = rng.sample(pool[:i] + pool[i + 1 :], rng.randint(0, max_shots))
        rows.append(json.dumps({"prompt": pack(ex, shots)[0]}))
    out.write_text("\n".join(rows) + "\n")
    return len(rows)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a prompts file from a corpus (see prompts_file)")
    ap.add_argument("--corpus", default="gsm8k")
    ap.add_argument("--n", type=int, default=600)
    ap.add_argument("--max-shots", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    print(prompts_file(load_corpus(a.corpus), a.n, a.max_shots, a.seed, a.out), "prompts written to", a.out)


if __name__ == "__main__":
    main()
