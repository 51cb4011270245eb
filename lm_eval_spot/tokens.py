"""Text from generated ids, and the stop ids a checkpoint's chat template really ends a turn with.

A model's output head can be wider than its tokenizer (Dream: 152,064 logits, 151,667 tokens; LLaDA pads to
126,464): the decoder takes the argmax / a sample over every logit, as the families' official generation does, so
an id the tokenizer does not know can be committed (rare with trained weights: those rows are never a training
target). Slow tokenizers fail on such an id (`decode` joins a None); fast ones return nothing for it. Here such
ids decode to nothing everywhere and are counted.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("lm_eval.spot")

# A reply no template alters (no whitespace to trim, no tag to split on), to find what follows it.
_PROBE = "SpotProbeReply"


def unknown_ids(tokenizer: Any, vocab_size: int) -> frozenset[int]:
    """Ids in [0, vocab_size) the tokenizer has no token for."""
    toks = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    return frozenset(i for i, t in enumerate(toks) if t is None)


@dataclass(frozen=True)
class TextDecoder:
    """ids -> text with ids the tokenizer does not know left out (special tokens skipped, as lm-eval's HF model)."""

    tokenizer: Any
    unknown: frozenset[int]

    @classmethod
    def for_target(cls, tokenizer: Any, vocab_size: int) -> TextDecoder:
        return cls(tokenizer, unknown_ids(tokenizer, vocab_size))

    def __call__(self, ids: Sequence[int]) -> str:
        known = [i for i in ids if i not in self.unknown] if self.unknown else list(ids)
        return self.tokenizer.decode(known, skip_special_tokens=True)

    def count_unknown(self, ids: Sequence[int]) -> int:
        return sum(i in self.unknown for i in ids) if self.unknown else 0


def _added_tokens(tokenizer: Any) -> dict[str, int]:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(getattr(tok, "content", tok)): int(i) for i, tok in decoder.items()}


def end_of_turn_ids(tokenizer: Any) -> dict[int, str]:
    """The special token the tokenizer's chat template writes right after an assistant reply ({id: token}), found
    by rendering a one-turn conversation; empty when there is no template or nothing special follows the reply."""
    if not getattr(tokenizer, "chat_template", None):
        return {}
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as err:  # noqa: BLE001 - a template that cannot render a plain turn: nothing to learn from it
        log.debug("spot-dlm: the chat template did not render a one-turn conversation (%s)", err)
        return {}
    if not isinstance(text, str) or _PROBE not in text:
        return {}
    after = text[text.rfind(_PROBE) + len(_PROBE):].lstrip(" \t\n")
    hits = [c for c in _added_tokens(tokenizer) if c and after.startswith(c)]
    if not hits:
        return {}
    best = max(hits, key=len)
    return {_added_tokens(tokenizer)[best]: best}
