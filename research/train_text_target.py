"""Train a natural-language block-diffusion target on a text corpus (the SDAR recipe, or LLaDA's with
`--attention bidirectional`), on CPU.

    python -m research.train_text_target --out DIR --corpus gsm8k [--tokenizer bpe:4096 | --tokenizer FOLDER]
        [--block-len 4] [--min-shots 0] [--max-shots 1] [--minutes 60] [model and training flags of research.train_target]

The model, masking, loss, schedule and checkpoints are `research.train_target`'s; only the data differ: packed
sequences of the corpus's examples (`research.text_corpus`) through a byte-level BPE tokenizer trained on the corpus
(`bpe:N`, N tokens; saved in DIR/tokenizer at the start so a resumed run reads the same ids) or an existing
tokenizer folder. Block-causal targets learn every token after a sequence's first prompt (the shots' answers and
questions too); bidirectional ones the example's own answer, on a canvas of --max-new positions. `--holdout`
examples drawn with the seed never train: DIR/eval.json reports their loss per token and greedy samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import time
from pathlib import Path
from typing import Any

import torch

from research import text_corpus as tc
from research.train_target import (
    ModelConfig, TrainConfig, batch_loss, greedy_decode, greedy_decode_bidirectional, make_batch,
    make_bidirectional_batch, train,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TextConfig:
    corpus: str = "gsm8k"
    tokenizer: str = "bpe:4096"  # bpe:N trains one on the corpus; anything else is a tokenizer folder
    max_shots: int = 1  # a sequence packs min_shots..max_shots other examples before its own
    min_shots: int = 0  # raised for long-context targets: batches pad to their longest sequence, so like lengths
    holdout: int = 200  # examples kept out of training (held-out loss, samples)
    samples: int = 3  # greedy samples written to eval.json
    max_len: int = 0  # sequences longer than this are dropped (0: the model's max_positions)

    def __post_init__(self) -> None:
        if not 0 <= self.min_shots <= self.max_shots:
            raise ValueError(f"need 0 <= min_shots <= max_shots, got {self.min_shots} and {self.max_shots}")


class TextData:
    """A text corpus as `research.train_target.TrainData`: packed sequences drawn with a seeded stream;
    validation and the final check are held-out loss per token (and greedy samples at the end)."""

    def __init__(self, cfg: TrainConfig, text: TextConfig, tok_dir: Path) -> None:
        examples = tc.load_corpus(text.corpus)
        self.train_set, self.held = tc.split_holdout(examples, text.holdout, cfg.seed)
        if text.tokenizer.startswith("bpe:"):
            if (tok_dir / "tokenizer.json").is_file():  # a resumed run: the ids its checkpoint was trained on
                self.tok = tc.load_tokenizer(str(tok_dir))
            else:
                size = int(text.tokenizer.removeprefix("bpe:"))
                self.tok = tc.train_bpe((e.prompt + e.answer for e in self.train_set), size)
                self.tok.save_pretrained(tok_dir)
        else:
            self.tok = tc.load_tokenizer(text.tokenizer)
        self.text, self.cfg = text, cfg
        self.loss_from = "answer" if cfg.attention == "bidirectional" else "first_answer"
        self.limit = text.max_len or cfg.model.max_positions
        self.rng = random.Random(cfg.seed * 7919 + 1)
        self.dropped = 0
        # The held-out examples zero-shot, encoded once: every check reads the same sequences.
        self.held_seqs = [tc.encode_packed(self.tok, e, [], "answer") for e in self.held]

    def _draw(self, rng: random.Random) -> tuple[list[int], int]:
        for _ in range(10_000):
            k = rng.randint(self.text.min_shots, self.text.max_shots)
            ex = rng.sample(self.train_set, k + 1)
            ids, p = tc.encode_packed(self.tok, ex[-1], ex[:-1], self.loss_from)
            if self.fits(ids, p):
                return ids, p
            self.dropped += 1
        raise ValueError(f"10,000 sequences in a row do not fit {self.limit} positions with answers of at most "
                         f"{self.cfg.max_new} tokens: raise --max-positions / --max-new or lower --max-shots")

    def fits(self, ids: list[int], p: int) -> bool:
        """Whether a sequence (prompt of p tokens) fits the model's positions and, bidirectional, the canvas of
        --max-new generated positions (answer and eos included)."""
        if self.loss_from != "answer":
            return len(ids) <= self.limit
        canvas = math.ceil(self.cfg.max_new / self.cfg.block_len) * self.cfg.block_len
        return p + canvas <= self.limit and len(ids) - p <= self.cfg.max_new

    def sequences(self, n: int) -> list[tuple[list[int], int]]:
        return [self._draw(self.rng) for _ in range(n)]

    def get_state(self) -> Any:
        return self.rng.getstate()

    def set_state(self, state: Any) -> None:
        self.rng.setstate(state)

    @torch.no_grad()
    def heldout_loss(self, model: Any, n: int = 64) -> float:
        """Mean cross-entropy per masked answer token on held-out zero-shot examples, masks drawn with a fixed
        seed (the same draws at every check, so checks compare)."""
        was = model.training
        model.eval()
        g = torch.Generator().manual_seed(1234)
        seqs = [s for s in self.held_seqs[:n] if self.fits(*s)]  # as training draws them (a long answer: skipped)
        total, count = 0.0, 0
        L, mask_id, eos = self.cfg.block_len, self.tok.mask_token_id, self.tok.eos_token_id
        for i in range(0, len(seqs), 8):
            chunk = seqs[i : i + 8]
            if self.cfg.attention == "bidirectional":
                b = make_bidirectional_batch(chunk, L, self.cfg.max_new, mask_id, eos, self.cfg.mask_eps, g)
            else:
                b = make_batch(chunk, L, mask_id, eos, self.cfg.mask_eps, g)
            loss, _ = batch_loss(model, b, "mean")
            k = int(b.masked.sum())
            total, count = total + float(loss) * k, count + k
        model.train(was)
        return total / max(1, count)

    def validate(self, model: Any, cfg: TrainConfig) -> str:
        return f"held-out loss {self.heldout_loss(model):.4f} per masked token (dropped {self.dropped} long sequences)"

    @torch.no_grad()
    def final_eval(self, model: Any, cfg: TrainConfig) -> dict:
        loss = self.heldout_loss(model, n=len(self.held))
        samples = []
        decode = greedy_decode_bidirectional if cfg.attention == "bidirectional" else greedy_decode
        for e in self.held[: self.text.samples]:
            ids = self.tok.encode(e.prompt, add_special_tokens=False)
            out = decode(model, ids, cfg.block_len, self.tok.mask_token_id, self.tok.eos_token_id, cfg.max_new)
            samples.append({"prompt": e.prompt, "reference": e.answer, "greedy": self.tok.decode(out)})
        log.info("held-out loss %.4f per masked token over %d examples", loss, len(self.held))
        return {"heldout_loss_per_token": loss, "heldout_examples": len(self.held), "samples": samples,
                "vocab_size": len(self.tok), "text_config": dataclasses.asdict(self.text)}


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, TextConfig]:
    p = argparse.ArgumentParser(prog="python -m research.train_text_target", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    for cls, skip in ((ModelConfig, ()), (TrainConfig, ("out", "model")), (TextConfig, ())):
        d = cls() if cls is not TrainConfig else TrainConfig(out="")
        for f in dataclasses.fields(cls):
            if f.name not in skip:
                p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(d, f.name)), default=getattr(d, f.name))
    a = vars(p.parse_args(argv))
    model = ModelConfig(**{f.name: a.pop(f.name) for f in dataclasses.fields(ModelConfig)})
    text = TextConfig(**{f.name: a.pop(f.name) for f in dataclasses.fields(TextConfig)})
    return TrainConfig(model=model, **a), text


def main(argv: list[str] | None = None) -> int:
    cfg, text = parse_args(argv)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "train.log")])
    (out / "text_config.json").write_text(json.dumps(dataclasses.asdict(text), indent=1) + "\n")
    t0 = time.time()
    final = train(cfg, TextData(cfg, text, out / "tokenizer"))
    log.info("done in %.1f min: %s", (time.time() - t0) / 60, final)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
