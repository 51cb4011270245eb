"""Chat templates as lm-eval's HF model gives them (`--apply_chat_template`), from the target's tokenizer."""

from __future__ import annotations

import re
from typing import Any

from lm_eval_spot.errors import SpotUserError


def chat_template_of(tokenizer: Any, chat_template: bool | str = False) -> str | None:
    """The template lm-eval applies (the results record its hash): named templates by name, else "default"."""
    if chat_template is False or chat_template is None:
        return None
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        name = chat_template if isinstance(chat_template, str) else "default"
        if name not in template:
            raise ValueError(f"spot-dlm: the tokenizer has no chat template named {name!r}; it has "
                             f"{', '.join(sorted(template))}")
        return template[name]
    return template or ""


def apply_chat(tokenizer: Any, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise SpotUserError(
            f"spot-dlm: --apply_chat_template needs a tokenizer with a chat template; "
            f"{tokenizer.name_or_path!r} has none (pass tokenizer=<folder with a chat template>)"
        )
    return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=add_generation_prompt)


def tokenizer_name(tokenizer: Any) -> str:
    """The tokenizer's name as a file-name-safe string (lm-eval puts it in cache and result paths)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "__", str(tokenizer.name_or_path))
