"""Number-aware tokenizer for spot_arith: every integer 0..199 is one token, every other character is one token.

Why: the task's arithmetic then becomes a single-token lookup (a, op, b) -> c per step, which a tiny model learns
in minutes, whereas digit-level tokens force it to learn carries first. Characters cover all of printable ASCII so
any prompt round-trips; the decoder concatenates pieces (no spaces are invented or dropped).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from pathlib import Path

EOS = "<|endoftext|>"
MASK = "<|mask|>"
UNK = "<unk>"
SPECIALS = (EOS, MASK, UNK)
MAX_NUMBER_TOKEN = 199
# Greedy pieces: 100..199, 10..99, single digits, then any single character. Digit runs outside 0..199 are split
# into in-vocabulary pieces (e.g. "250" -> "25", "0"), so decode(encode(x)) == x for every ASCII string.
PRETOKEN_REGEX = r"1\d\d|[1-9]\d|\d|[\s\S]"


def vocabulary() -> dict[str, int]:
    """Fixed vocabulary: specials, the numbers 0..199, then every printable ASCII non-digit character."""
    numbers = [str(i) for i in range(MAX_NUMBER_TOKEN + 1)]
    chars = [c for c in string.printable if not c.isdigit()]
    return {tok: i for i, tok in enumerate([*SPECIALS, *numbers, *chars])}


def build_tokenizer():
    """A transformers PreTrainedTokenizerFast (eos = pad = <|endoftext|>, mask = <|mask|>, no BOS)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocabulary(), unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKEN_REGEX), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,  # the default cleanup would rewrite " ." and " ,"
        model_max_length=512,
    )


def save_tokenizer(out_dir: str | Path):
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json; returns the tokenizer."""
    tok = build_tokenizer()
    tok.save_pretrained(str(out_dir))
    return tok


def check_round_trip(tok, texts: Iterable[str]) -> list[str]:
    """Texts that do not survive decode(encode(x)) (empty list = all good)."""
    return [t for t in texts if tok.decode(tok.encode(t, add_special_tokens=False)) != t]
