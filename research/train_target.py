"""Train the embedded spot_arith block-diffusion target (SDAR recipe) on CPU.

    python -m research.train_target --out DIR [--minutes M | --steps N] [--seed S] [--hidden H] [--layers K] ...

Model: transformers' native Qwen3ForCausalLM (no remote code), tied embeddings, trained as a block-diffusion LM with
block length L = 32 aligned to absolute position 0. Each training sequence is prompt + answer + eos, padded with
eos to a multiple of L. The input is [clean blocks ; noisy copy of all blocks]: a noisy block k sees clean blocks
< k and itself (lm_eval_spot.adapters.attention_masks.dual_stream_allowed), exactly what it sees at inference where earlier blocks sit
in the prefix cache. Each noisy block draws t ~ U(eps, 1] and masks every answer position (never the prompt) with
probability t; the loss is cross-entropy on masked positions, logits position-aligned (position i predicts token i).

`--attention bidirectional` trains a fully bidirectional target instead (LLaDA's architecture in transformers' Llama
classes): each sequence is a canvas of the prompt and --max-new positions in whole blocks from the prompt's end
(answer, eos, eos padding), with one active block per row partly masked, the blocks before it clean and every
block after it all masks (the states semi-autoregressive decoding meets); the loss is on the active block's masked
positions. It is saved as a LLaDA checkpoint (`research/llada_checkpoint.py`), run by the `llada` family.

Reruns with the same --out resume from DIR/checkpoint.pt. At the end DIR/final/ holds the safetensors model
(config.block_length = 32) and the tokenizer, and DIR/eval.json the exact match of greedy one-commit-per-forward
decoding on the first --eval-n test problems.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# With more runnable threads than cores, OpenMP's default busy-waiting slows training by >10x; passive waiting
# degrades gracefully. Only effective when set before torch (and its OpenMP runtime) is first imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from lm_eval_spot.arith import generator as gen  # noqa: E402
from lm_eval_spot.arith.tokenizer import build_tokenizer  # noqa: E402
from lm_eval_spot.adapters.attention_masks import allowed_to_additive, block_causal_allowed, dual_stream_allowed  # noqa: E402

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 128
    layers: int = 3
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 0  # 0 -> 4 * hidden
    max_positions: int = 512
    rope_theta: float = 10_000.0


@dataclass(frozen=True)
class TrainConfig:
    out: str
    model: ModelConfig = field(default_factory=ModelConfig)
    seed: int = 0
    minutes: float = 60.0  # training budget; sets the step count when --steps is 0
    steps: int = 0
    batch: int = 32
    lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    mask_eps: float = 1e-3
    loss_weight: str = "mean"  # "mean": mean CE over masked tokens; "inv_t": MDLM/SDAR 1/t-weighted ELBO
    block_len: int = 32
    # "block_causal": the SDAR recipe above (Qwen3 layout). "bidirectional": every position attends every other
    # (LLaDA's layout, saved as a LLaDA checkpoint); trained on the states semi-autoregressive decoding meets.
    attention: str = "block_causal"
    # bidirectional only: the share of rows masked LLaDA's way instead (every generated position, the eos padding
    # included, masked with one probability t; the loss on all of them): ten times the supervision of a row's one
    # active block, on states semi-autoregressive decoding does not meet
    full_mask_frac: float = 0.0
    ckpt_every: int = 250
    log_every: int = 50
    val_every: int = 500
    val_n: int = 20
    eval_n: int = 100
    max_new: int = 256
    threads: int = 2
    calib_steps: int = 30
    stop_after: int = 0  # >0: leave after this many steps in this invocation (simulates an interruption)


# ----------------------------------------------------------------------------------------------------- model


def _config_kwargs(mc: ModelConfig, tok) -> dict:
    """What both layouts' transformers configs share: the sizes, tied embeddings, the tokenizer's ids."""
    return dict(
        vocab_size=len(tok),
        hidden_size=mc.hidden,
        intermediate_size=mc.intermediate or 4 * mc.hidden,
        num_hidden_layers=mc.layers,
        num_attention_heads=mc.heads,
        num_key_value_heads=mc.kv_heads,
        head_dim=mc.hidden // mc.heads,
        max_position_embeddings=mc.max_positions,
        rope_theta=mc.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="sdpa",
    )


def build_model(mc: ModelConfig, tok, block_len: int, attention: str = "block_causal"):
    if attention == "bidirectional":
        return build_bidirectional_model(mc, tok)
    if attention != "block_causal":
        raise ValueError(f"attention must be block_causal or bidirectional, got {attention!r}")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**_config_kwargs(mc, tok))
    cfg.block_length = block_len
    cfg.mask_token_id = tok.mask_token_id
    return Qwen3ForCausalLM(cfg)


def build_bidirectional_model(mc: ModelConfig, tok):
    """LLaDA's architecture in transformers' Llama classes (what the `llada` family runs natively)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**_config_kwargs(mc, tok)))


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates the tied embedding


# ----------------------------------------------------------------------------------------------------- data


def encode_problem(tok, problem: gen.Problem) -> tuple[list[int], int]:
    """(prompt + answer + eos ids, prompt length)."""
    prompt = tok.encode(gen.make_prompt(problem["question"]), add_special_tokens=False)
    answer = tok.encode(problem["answer"], add_special_tokens=False)
    return prompt + answer + [tok.eos_token_id], len(prompt)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor  # [B, Tc + T]: clean blocks 0..nb-2, then the noisy copy of blocks 0..nb-1
    position_ids: torch.Tensor  # [1, Tc + T] absolute positions of both streams
    attention_mask: torch.Tensor  # [1, 1, Tc + T, Tc + T] additive
    labels: torch.Tensor  # [B, T]
    masked: torch.Tensor  # [B, T] bool: noisy positions replaced by the mask token (the loss positions)
    t: torch.Tensor  # [B, T] the mask ratio of each position's block
    n_targets: int  # answer + eos positions in the batch (the 1/t estimator's normaliser)


def make_batch(
    seqs: list[tuple[list[int], int]], block_len: int, mask_id: int, eos_id: int, eps: float, g: torch.Generator
) -> Batch:
    L = block_len
    padded = [math.ceil(len(ids) / L) * L for ids, _ in seqs]
    T = max(padded)
    B = len(seqs)
    labels = torch.full((B, T), eos_id, dtype=torch.long)
    target = torch.zeros(B, T, dtype=torch.bool)
    for i, ((ids, p), n) in enumerate(zip(seqs, padded)):
        labels[i, : len(ids)] = torch.tensor(ids)
        target[i, p:n] = True  # answer, eos and eos padding of the last block; never the prompt
    # Blocks past a row's own length are never visible to its real positions (block-causal, whole blocks), so
    # they only need to be kept out of the loss.
    t = eps + (1.0 - eps) * torch.rand(B, T // L, generator=g)
    t = t.repeat_interleave(L, dim=1)
    masked = (torch.rand(B, T, generator=g) < t) & target
    noisy = torch.where(masked, torch.full_like(labels, mask_id), labels)
    # The clean copy of the last block is attended by nothing, so it is left out.
    Tc = T - L
    clean_pos, noisy_pos = torch.arange(Tc), torch.arange(T)
    allowed = dual_stream_allowed(clean_pos, noisy_pos, L)
    return Batch(
        input_ids=torch.cat([labels[:, :Tc], noisy], dim=1),
        position_ids=torch.cat([clean_pos, noisy_pos]).unsqueeze(0),
        attention_mask=allowed_to_additive(allowed, torch.float32).unsqueeze(0),
        labels=labels,
        masked=masked,
        t=t,
        n_targets=int(target.sum()),
    )


def make_bidirectional_batch(
    seqs: list[tuple[list[int], int]], block_len: int, gen_len: int, mask_id: int, eos_id: int, eps: float,
    g: torch.Generator, full_mask_frac: float = 0.0,
) -> Batch:
    """Fully bidirectional canvases as semi-autoregressive decoding meets them: prompt, then `gen_len` positions
    (whole blocks from the prompt's end: answer, eos, eos padding). Per row one block k (up to the block holding
    the first eos) is the active one: blocks before it clean, its positions masked with probability t ~ U(eps, 1],
    every block after it all masks. The loss is on the active block's masked positions. A `full_mask_frac` share
    of rows is masked LLaDA's way instead: every generated position with one probability t, the loss on all of
    them. Rows are right-padded to the batch's longest canvas; their padding is invisible to every position."""
    L = block_len
    G = math.ceil(gen_len / L) * L
    B = len(seqs)
    N = max(p for _, p in seqs) + G
    labels = torch.full((B, N), eos_id, dtype=torch.long)
    noisy = torch.empty_like(labels)
    masked = torch.zeros(B, N, dtype=torch.bool)
    visible = torch.zeros(B, N, dtype=torch.bool)
    t = torch.ones(B, N)
    n_targets = 0
    for i, (ids, p) in enumerate(seqs):
        if len(ids) - p > G:
            raise ValueError(f"an answer of {len(ids) - p} tokens (eos included) exceeds the canvas' {G}")
        labels[i, : len(ids)] = torch.tensor(ids)
        visible[i, : p + G] = True
        k = int(torch.randint(0, (len(ids) - 1 - p) // L + 1, (1,), generator=g))  # the eos's block at most
        a, b = p + k * L, p + (k + 1) * L
        ratio = eps + (1.0 - eps) * float(torch.rand(1, generator=g))
        if full_mask_frac > 0 and float(torch.rand(1, generator=g)) < full_mask_frac:
            a, b = p, p + G
        masked[i, a:b] = torch.rand(b - a, generator=g) < ratio
        t[i, a:b] = ratio
        n_targets += b - a
        noisy[i] = labels[i]
        noisy[i, a:b] = torch.where(masked[i, a:b], mask_id, labels[i, a:b])
        noisy[i, b : p + G] = mask_id
    allowed = visible[:, None, None, :] | torch.eye(N, dtype=torch.bool)  # padding sees itself: no NaN rows
    additive = torch.zeros(B, 1, N, N).masked_fill_(~allowed, float("-inf"))
    return Batch(input_ids=noisy, position_ids=torch.arange(N).unsqueeze(0), attention_mask=additive, labels=labels,
                 masked=masked, t=t, n_targets=n_targets)


def batch_loss(model, batch: Batch, loss_weight: str) -> tuple[torch.Tensor, float]:
    """(loss, accuracy on masked tokens)."""
    B, T = batch.labels.shape
    hidden = model.model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids.expand(B, -1),
        use_cache=False,
    ).last_hidden_state[:, -T:]
    if not bool(batch.masked.any()):
        return hidden.sum() * 0.0, 1.0
    logits = model.lm_head(hidden[batch.masked])  # only masked positions need logits
    labels = batch.labels[batch.masked]
    ce = F.cross_entropy(logits.float(), labels, reduction="none")
    if loss_weight == "inv_t":
        loss = (ce / batch.t[batch.masked]).sum() / batch.n_targets
    elif loss_weight == "mean":
        loss = ce.mean()
    else:
        raise ValueError(f"unknown loss_weight {loss_weight!r}")
    acc = float((logits.argmax(-1) == labels).float().mean())
    return loss, acc


def lr_at(step: int, cfg: TrainConfig, total: int) -> float:
    """Linear warmup then cosine decay to min_lr_frac * lr at `total`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = min(1.0, (step - cfg.warmup) / max(1, total - cfg.warmup))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------------------------------- decoding


@torch.inference_mode()
def greedy_decode(model, prompt_ids: list[int], block_len: int, mask_id: int, eos_id: int, max_new: int) -> list[int]:
    """Block-diffusion greedy decoding, one commit per forward, full recompute (no KV cache).

    Blocks are aligned to absolute position 0, so the prompt's tail shares the first active block. Each forward
    runs the whole sequence under the block-causal mask (equivalent to the prefix cache + active block), then
    commits the masked position of the active block with the highest max-softmax confidence (its argmax token).
    Stops once an eos is committed with everything before it committed, or after max_new tokens.
    Returns the generated ids up to (excluding) the first eos.
    """
    start = len(prompt_ids)
    seq = torch.tensor(prompt_ids, dtype=torch.long)
    while seq.numel() - start < max_new:
        b0 = seq.numel()
        b1 = min((b0 // block_len + 1) * block_len, start + max_new)
        seq = torch.cat([seq, torch.full((b1 - b0,), mask_id, dtype=torch.long)])
        pos = torch.arange(seq.numel())
        mask = allowed_to_additive(block_causal_allowed(pos, pos, block_len), torch.float32).unsqueeze(0)
        done = False
        while bool((seq[b0:b1] == mask_id).any()):
            logits = model(input_ids=seq[None], attention_mask=mask, position_ids=pos[None], use_cache=False).logits
            logits = logits[0, b0:b1].float()
            logits[:, mask_id] = float("-inf")  # committing the mask token would never finish the block
            conf, tok = logits.softmax(-1).max(-1)
            is_masked = seq[b0:b1] == mask_id
            j = int(torch.where(is_masked, conf, torch.full_like(conf, -1.0)).argmax())
            seq[b0 + j] = tok[j]
            if int(tok[j]) == eos_id and not bool(is_masked[:j].any()):
                done = True  # everything before this eos is final; later commits cannot change the text
                break
        gen_ids = seq[start:].tolist()
        if done or eos_id in gen_ids:
            return gen_ids[: gen_ids.index(eos_id)]
    return seq[start:].tolist()


@torch.inference_mode()
def greedy_decode_bidirectional(model, prompt_ids: list[int], block_len: int, mask_id: int, eos_id: int,
                                max_new: int) -> list[int]:
    """Semi-autoregressive greedy decoding of a fully bidirectional target, one commit per forward: the canvas is
    the prompt and max_new positions (whole blocks from the prompt's end), all masks; blocks are decoded in order,
    each forward running the whole canvas, committing the active block's most confident masked slot (its argmax
    token). Stops once an eos is committed with everything before it committed. Returns the ids before the eos."""
    P = len(prompt_ids)
    G = math.ceil(max_new / block_len) * block_len
    seq = torch.tensor(prompt_ids + [mask_id] * G, dtype=torch.long)
    pos = torch.arange(seq.numel())[None]
    mask = torch.zeros(1, 1, seq.numel(), seq.numel())
    for b0 in range(P, P + G, block_len):
        b1 = b0 + block_len
        while bool((seq[b0:b1] == mask_id).any()):
            logits = model(input_ids=seq[None], attention_mask=mask, position_ids=pos, use_cache=False).logits
            logits = logits[0, b0:b1].float()
            logits[:, mask_id] = float("-inf")
            conf, tok = logits.softmax(-1).max(-1)
            is_masked = seq[b0:b1] == mask_id
            j = int(torch.where(is_masked, conf, torch.full_like(conf, -1.0)).argmax())
            seq[b0 + j] = tok[j]
            if int(tok[j]) == eos_id and not bool((seq[P : b0 + j] == mask_id).any()):
                out = seq[P:].tolist()
                return out[: out.index(eos_id)]
    out = seq[P:].tolist()
    return out[: out.index(eos_id)] if eos_id in out else out


def extract_answer(text: str) -> str | None:
    m = STRICT_RE.search(text)
    return m.group(1) if m else None


def evaluate(model, tok, problems: list[gen.Problem], block_len: int, max_new: int,
             attention: str = "block_causal") -> dict:
    """Exact match of the strict '#### N' answer under greedy_decode (greedy_decode_bidirectional)."""
    was_training = model.training
    model.eval()
    samples = []
    decode = greedy_decode_bidirectional if attention == "bidirectional" else greedy_decode
    for p in problems:
        prompt = tok.encode(gen.make_prompt(p["question"]), add_special_tokens=False)
        out = decode(model, prompt, block_len, tok.mask_token_id, tok.eos_token_id, max_new)
        text = tok.decode(out)
        pred = extract_answer(text)
        samples.append({"question": p["question"], "final": p["final"], "pred": pred, "output": text})
    model.train(was_training)
    correct = sum(s["pred"] == str(s["final"]) for s in samples)
    return {"exact_match": correct / max(1, len(samples)), "n": len(samples), "samples": samples}


class TrainData(Protocol):
    """What a training run reads: its tokenizer, an endless stream of (ids, prompt length) sequences whose state
    a checkpoint keeps, and its checks (a periodic one on validation data, a final one written to eval.json).
    `ArithData` is the spot_arith task's; `research.text_corpus.TextData` a text corpus's."""

    tok: Any

    def sequences(self, n: int) -> list[tuple[list[int], int]]: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...

    def validate(self, model: Any, cfg: TrainConfig) -> str: ...

    def final_eval(self, model: Any, cfg: TrainConfig) -> dict: ...


class ArithData:
    """spot_arith problems from the task's generator (test questions excluded); checks: exact match of greedy
    one-commit-per-forward decoding."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.tok = build_tokenizer()
        self.rng = random.Random(gen.TRAIN_SEED * 1000 + cfg.seed)
        self.stream = gen.iter_problems(self.rng, exclude=gen.test_questions())
        self.val = gen.make_split("val", cfg.val_n)

    def sequences(self, n: int) -> list[tuple[list[int], int]]:
        return [encode_problem(self.tok, next(self.stream)) for _ in range(n)]

    def get_state(self) -> Any:
        return self.rng.getstate()

    def set_state(self, state: Any) -> None:
        self.rng.setstate(state)  # the generator reads self.rng lazily: the stream continues from here

    def validate(self, model: Any, cfg: TrainConfig) -> str:
        r = evaluate(model, self.tok, self.val, cfg.block_len, cfg.max_new, cfg.attention)
        return f"val exact_match {r['exact_match']:.3f} (n={r['n']})"

    def final_eval(self, model: Any, cfg: TrainConfig) -> dict:
        test = gen.make_split("test", gen.TEST_SIZE)[: cfg.eval_n]
        r = evaluate(model, self.tok, test, cfg.block_len, cfg.max_new, cfg.attention)
        log.info("test exact_match %.3f on the first %d test problems", r["exact_match"], r["n"])
        return r


# ----------------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: Path, state: dict) -> None:
    """Atomic: a crash mid-write leaves the previous checkpoint intact."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict | None:
    return torch.load(path, weights_only=True) if path.exists() else None


# ----------------------------------------------------------------------------------------------------- training


# Settings that do not change the weights a run ends with (where it writes, how often it reports or stops).
_NOT_SHAPING = {"out", "model", "ckpt_every", "log_every", "val_every", "val_n", "eval_n", "max_new", "threads",
                "stop_after", "steps", "minutes", "calib_steps"}


def _run_config(cfg: TrainConfig) -> dict:
    """The settings a resumed run must share with the checkpoint's (the step total is saved with it)."""
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _NOT_SHAPING}


def train(cfg: TrainConfig, data: TrainData | None = None) -> Path:
    """Train (or resume) into cfg.out on `data` (spot_arith's problems unless given); returns the final model
    directory (or the out dir if stopped early)."""
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, data if data is not None else ArithData(cfg))
    finally:
        torch.set_num_threads(prev_threads)  # a library call should not leave the process reconfigured


def _train(cfg: TrainConfig, data: TrainData) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = data.tok
    L = cfg.block_len

    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, tok, L, cfg.attention)
    model.train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )
    mask_gen = torch.Generator().manual_seed(cfg.seed)
    step, total, train_s = 0, cfg.steps, 0.0

    ckpt_path = out / CHECKPOINT
    state = load_checkpoint(ckpt_path)
    if state is not None:
        if state["model_config"] != dataclasses.asdict(cfg.model):
            raise ValueError(f"{ckpt_path} was trained with {state['model_config']}, not {cfg.model}")
        recorded = state.get("run_config")
        if recorded is not None:
            recorded = {"attention": "block_causal", "full_mask_frac": 0.0, **recorded}  # runs from before the field existed
        if recorded is not None and recorded != _run_config(cfg):
            diff = ", ".join(f"{k}={recorded.get(k)!r} (now {v!r})" for k, v in _run_config(cfg).items()
                             if recorded.get(k) != v)
            raise ValueError(f"{ckpt_path} is from another training run: {diff}; rerun with its settings or use "
                             "another --out")
        model.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        data.set_state(state["data_rng"])
        mask_gen.set_state(state["mask_gen"])
        step, total, train_s = state["step"], state["total"], state["train_s"]
        log.info("resumed from %s at step %d / %d", ckpt_path, step, total)

    n_params = count_params(model)
    log.info("model: %s, %d parameters; train config: %s", cfg.model, n_params, cfg)

    def checkpoint() -> None:
        save_checkpoint(
            ckpt_path,
            {
                "model": model.state_dict(),
                "optim": optim.state_dict(),
                "data_rng": data.get_state(),
                "mask_gen": mask_gen.get_state(),
                "step": step,
                "total": total,
                "train_s": train_s,
                "model_config": dataclasses.asdict(cfg.model),
                "run_config": _run_config(cfg),
            },
        )

    if total == 0 and cfg.warmup < cfg.calib_steps:
        raise ValueError("with --steps 0 the step count is calibrated during warmup: need warmup >= calib_steps")

    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    tty = sys.stderr.isatty()
    bar = tqdm(total=total or None, initial=step, desc="train", mininterval=1 if tty else 60, disable=None)
    run_steps = 0
    calib_t0, loss_sum, acc_sum, n_sum = None, 0.0, 0.0, 0
    with logging_redirect_tqdm():
        while total == 0 or step < total:
            if cfg.stop_after and run_steps >= cfg.stop_after:
                break
            t0 = time.perf_counter()
            lr = lr_at(step, cfg, total)
            for group in optim.param_groups:
                group["lr"] = lr
            seqs = data.sequences(cfg.batch)
            if cfg.attention == "bidirectional":
                batch = make_bidirectional_batch(seqs, L, cfg.max_new, tok.mask_token_id, tok.eos_token_id,
                                                 cfg.mask_eps, mask_gen, cfg.full_mask_frac)
            else:
                batch = make_batch(seqs, L, tok.mask_token_id, tok.eos_token_id, cfg.mask_eps, mask_gen)
            loss, acc = batch_loss(model, batch, cfg.loss_weight)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optim.step()
            step += 1
            run_steps += 1
            train_s += time.perf_counter() - t0
            loss_sum, acc_sum, n_sum = loss_sum + loss.item(), acc_sum + acc, n_sum + 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.3f}", lr=f"{lr:.2e}", refresh=False)

            if total == 0:  # calibrate the step count from the measured speed (first 3 steps are warm-up)
                if step == 3:
                    calib_t0 = time.perf_counter()
                elif step == cfg.calib_steps:
                    sps = (time.perf_counter() - calib_t0) / (cfg.calib_steps - 3)
                    total = max(cfg.calib_steps, int(cfg.minutes * 60 / sps))
                    bar.total = total
                    log.info("calibrated: %.3f s/step -> %d steps for %.1f min", sps, total, cfg.minutes)
            if step % cfg.log_every == 0:
                log.info(
                    "step %d/%d loss %.4f masked-acc %.3f lr %.2e %.3f s/step (avg)",
                    step, total, loss_sum / n_sum, acc_sum / n_sum, lr, train_s / step,
                )
                loss_sum, acc_sum, n_sum = 0.0, 0.0, 0
            if cfg.val_every and step % cfg.val_every == 0 and cfg.val_n:
                log.info("step %d %s", step, data.validate(model, cfg))
            if step % cfg.ckpt_every == 0:
                checkpoint()
    bar.close()
    checkpoint()
    if total == 0 or step < total:
        log.info("stopped at step %d (stop_after=%d); rerun to resume", step, cfg.stop_after)
        return out

    final = out / "final"
    model.eval()
    if cfg.attention == "bidirectional":
        from research.llada_checkpoint import save_as_llada

        save_as_llada(model, final, tok.mask_token_id, L)
    else:
        model.config.block_length = L
        model.save_pretrained(final, safe_serialization=True)
    tok.save_pretrained(final)
    log.info("saved %s (%d parameters, %.1f min of training)", final, n_params, train_s / 60)

    if cfg.eval_n:
        t0 = time.perf_counter()
        r = data.final_eval(model, cfg)
        train_config = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "model"}
        r.update(
            eval_s=time.perf_counter() - t0,
            train_minutes=train_s / 60,
            steps=step,
            params=n_params,
            model_config=dataclasses.asdict(cfg.model),
            train_config=train_config,
        )
        (out / "eval.json").write_text(json.dumps(r, indent=1) + "\n")
        log.info("final evaluation took %.0f s: %s", r["eval_s"], out / "eval.json")
    return final


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="python -m research.train_target", description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="run directory (checkpoints, final/, eval.json); reruns resume")
    md, td = ModelConfig(), TrainConfig(out="")
    for f in dataclasses.fields(ModelConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(md, f.name)), default=getattr(md, f.name))
    for f in dataclasses.fields(TrainConfig):
        if f.name in ("out", "model"):
            continue
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(td, f.name)), default=getattr(td, f.name))
    a = vars(p.parse_args(argv))
    model = ModelConfig(**{f.name: a.pop(f.name) for f in dataclasses.fields(ModelConfig)})
    return TrainConfig(model=model, **a)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.StreamHandler(), logging.FileHandler(Path(cfg.out) / "train.log")],
    )
    t0 = time.time()
    final = train(cfg)
    print(f"done in {(time.time() - t0) / 60:.1f} min: {final}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
