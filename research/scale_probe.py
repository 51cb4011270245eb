"""Per-round cost at real vocabulary width: a random-init target with a real family's shape, through the whole loop.

    python -m research.scale_probe                       # Qwen3-shaped, vocab 151,936, hidden 1,024, 2 layers
    python -m research.scale_probe --shape sdar-1.7b --device cuda --dtype bfloat16 --curve
    python -m research.scale_probe --check --device cuda --out gpu_check.json   # scripts/gpu_check.sh

Acceptance does not matter for what this measures (a random-weight drafter proposes the trees), only the cost
of a round: for control and SPOT (D = 8 by default) at T = 0 and T = 1 it reports the bytes read back from the
target's device per round (`HostLink`: on the CPU the same tensors a GPU run would move), and the share of the
decode's wall time spent outside the target forwards (drafting, transitions, verification, noise, transfers).
The drafter runs on the host (numpy fast path) unless --drafter-device says otherwise. `--curve` adds the
forward-time curve t(R) for R = 1..21 replicas. Writes JSON (--out) and logs a table.

`--check` is the device check of `scripts/gpu_check.sh`: one JSON with t(R) at two prompt lengths for the fused
and the reference shared-prefix attention, the decode shares, batch-shape invariance at R = 9 and 21, and the
embedded benchmark's NFE and throughput ratios. It imports neither lm-eval nor datasets (their wheels alone would
exceed what a lent GPU machine can be sent): only torch and `scripts/gpu_wheels.txt`.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from lm_eval_spot.adapters.base import TargetInfo
from lm_eval_spot.adapters.block_causal import BlockCausalAdapter
from lm_eval_spot.decoding.loop import DecodeConfig, decode
from lm_eval_spot.transfer import sync
from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
from research.report import report

log = logging.getLogger("research.scale_probe")

VOCAB = 151_936
# Public shapes (config.json fields of the released checkpoints); weights are random. "tiny" only exercises the
# code paths (the quick CPU run of the device check).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-small": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128),
    "sdar-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                      num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
}
ATTENTIONS = ("fused", "reference")


def build_model(shape: str, layers: int | None, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-init Qwen3 causal LM of the shape, created on the device (a 1.7B init on the host takes minutes)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = dict(SHAPES[shape])
    fields.setdefault("vocab_size", VOCAB)
    if layers is not None:
        fields["num_hidden_layers"] = layers
    cfg = Qwen3Config(max_position_embeddings=4096, tie_word_embeddings=True, attn_implementation="sdpa", **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg)
    return model.to(dtype=dtype).eval()


def make_adapter(model: torch.nn.Module, block_len: int, attention: str = "fused") -> BlockCausalAdapter:
    vocab = model.config.vocab_size
    info = TargetInfo(mask_id=vocab - 1, stop_ids=frozenset(), block_len=block_len, grid_origin="zero",
                      exact_prefix_cache=True, vocab_size=vocab)
    return BlockCausalAdapter(model, info, attention=attention)


def build_target(shape: str, layers: int | None, device: str, dtype: torch.dtype, block_len: int,
                 attention: str = "fused") -> BlockCausalAdapter:
    return make_adapter(build_model(shape, layers, device, dtype), block_len, attention)


def random_prompt(vocab: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab - 1, (n,), generator=gen).tolist()


def forward_curve(adapter: BlockCausalAdapter, prompt: list[int], rs: list[int], repeats: int
                  ) -> tuple[dict[int, float], dict[int, float]]:
    """Median seconds of one forward of R replicas of a half-committed block after the prompt's prefix, and (on
    CUDA) the peak memory of one such forward above what was allocated before it, in MiB."""
    L = adapter.info.block_len
    session, _ = adapter.open(prompt)
    block = torch.full((L,), adapter.info.mask_id, dtype=torch.long)
    block[: L // 2] = 7
    session.block_logits(block[None])  # stores the prefix
    cuda = adapter.device.type == "cuda"
    times: dict[int, float] = {}
    peak: dict[int, float] = {}
    for r in rs:
        rows = block[None].repeat(r, 1)
        samples = []
        for i in range(repeats):
            sync(adapter.device)
            if cuda and i == 0:
                torch.cuda.reset_peak_memory_stats(adapter.device)
                base = torch.cuda.memory_allocated(adapter.device)
            t0 = time.perf_counter()
            session.block_logits(rows)
            sync(adapter.device)
            samples.append(time.perf_counter() - t0)
            if cuda and i == 0:
                peak[r] = (torch.cuda.max_memory_allocated(adapter.device) - base) / 2**20
        times[r] = statistics.median(samples)
    return times, peak


def host_peak_mib(fn: Any) -> float:
    """Peak of torch's CPU allocations while `fn()` runs, above what was allocated before it (MiB), from the
    profiler's allocation records (RSS would hide it behind the allocator's caches)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    current = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        current += ev.self_cpu_memory_usage
        peak = max(peak, current)
    return peak / 2**20


def memory_table(adapter: BlockCausalAdapter, prompt: list[int], rs: tuple[int, ...] = (1, 9, 21)
                 ) -> dict[str, dict[str, dict[int, float]]]:
    """Peak memory (MiB) at R replicas after the prompt's prefix, fused against reference shared-prefix attention
    on the same model: of one whole forward (at a real vocabulary its R x L x V logits dominate) and of one
    layer's attention alone (where the reference path's R x L x prefix scores show)."""
    from lm_eval_spot.adapters.prefix_attention import PrefixPass

    L = adapter.info.block_len
    cfg = adapter.model.config
    H, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    out: dict[str, dict[str, dict[int, float]]] = {"forward": {}, "attention_layer": {}}
    gen = torch.Generator().manual_seed(0)
    for attention in ("reference", "fused"):
        ad = make_adapter(adapter.model, L, attention)
        session, _ = ad.open(prompt)
        block = torch.full((L,), ad.info.mask_id, dtype=torch.long)
        block[: L // 2] = 7
        session.block_logits(block[None])  # stores the prefix
        out["forward"][attention], out["attention_layer"][attention] = {}, {}
        for r in rs:
            rows = block[None].repeat(r, 1)
            with torch.no_grad():
                out["forward"][attention][r] = host_peak_mib(lambda rows=rows: session.block_logits(rows))
            q, k, v = (torch.randn(r, n, L, d, generator=gen).to(ad.dtype) for n in (H, kvh, kvh))
            pp = PrefixPass([(0, r, session.prefix_kv)], torch.zeros(L, L, dtype=ad.dtype), kernel=ad.kernel,
                            dense=True)
            out["attention_layer"][attention][r] = host_peak_mib(lambda pp=pp, q=q, k=k, v=v: pp.attend(0, q, k, v, d**-0.5))
    return out


def batch_invariance(adapter: BlockCausalAdapter, prompt: list[int], rs: list[int], trials: int) -> dict[int, dict]:
    """For each R: a state's logits as row r of R replicas (the others random states) against the same state
    alone: the largest absolute difference, and how often the target's transition (position, token) differs."""
    from lm_eval_spot.decoding.transition import transition

    info = adapter.info
    L, mask = info.block_len, info.mask_id
    session, _ = adapter.open(prompt)
    gen = torch.Generator().manual_seed(5)
    warm = torch.full((1, L), mask, dtype=torch.long)
    session.block_logits(warm)  # stores the prefix
    out: dict[int, dict] = {}
    for R in rs:
        worst, flips, rows = 0.0, 0, 0
        for _ in range(trials):
            states = torch.full((R, L), mask, dtype=torch.long)
            keep = torch.rand(R, L, generator=gen) < 0.5
            states[keep] = torch.randint(0, info.vocab_size - 1, (int(keep.sum()),), generator=gen)
            together = session.block_logits(states)
            for r in range(R):
                alone = session.block_logits(states[r : r + 1])[0]
                worst = max(worst, float((together[r] - alone).abs().max()))
                elig = (states[r] == mask)[None].to(adapter.device)
                if bool(elig.any()):
                    a = transition(alone[None].clone(), elig, 0.0, None)
                    b = transition(together[r : r + 1].clone(), elig, 0.0, None)
                    flips += int(not (torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])))
                    rows += 1
        out[R] = {"max_abs_logit_diff": worst, "transition_flips": flips, "rows": rows}
    return out


def random_drafter(block_len: int, device: str) -> FactoredOrderModel:
    # On the host by default: the CPU path drafts from numpy tables, the path real runs take on every device.
    torch.manual_seed(2)
    return FactoredOrderModel(FactoredConfig(max_block_len=max(64, block_len))).to(device).eval()


def decode_shares(adapter: BlockCausalAdapter, drafter: FactoredOrderModel, prompt: list[int], temps: list[float],
                  budget: int, gen: int) -> list[dict[str, Any]]:
    """Control and SPOT (budget D) decodes: rounds, bytes to the host, and the share of wall time outside the
    target forwards."""
    runs = []
    decode(adapter, prompt, DecodeConfig(max_gen_toks=4), seed=0)  # warm-up (allocator, kernels)
    for T in temps:
        for mode in ("control", "spot"):
            prop = TreeProposer(LearnedOrder(drafter), TreeConfig(budget=budget)) if mode == "spot" else None
            res = decode(adapter, prompt, DecodeConfig(max_gen_toks=gen, temperature=T), seed=3, proposer=prop)
            outside = res.wall_s - res.timing.forward
            runs.append({
                "mode": mode, "temperature": T, "budget": budget if mode == "spot" else 0, "prompt_len": len(prompt),
                "rounds": res.rounds, "nfe": res.nfe.total,
                "replicas_per_round": (sum(res.drafted) + res.rounds) / res.rounds,
                "host_bytes_per_round": res.host_bytes / res.rounds,
                "wall_s": res.wall_s, "forward_s": res.timing.forward, "draft_s": res.timing.draft,
                "rest_s": res.timing.rest, "outside_share": outside / res.wall_s,
            })
            log.info("%s T=%g P=%d: %d rounds, %.0f B/round to host, %.1f%% of %.2f s outside the forward", mode, T,
                     len(prompt), res.rounds, res.host_bytes / res.rounds, 100 * outside / res.wall_s, res.wall_s)
    return runs


def machine() -> dict[str, Any]:
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "gpu": gpu, "threads": torch.get_num_threads()}


def probe(args: argparse.Namespace) -> dict[str, Any]:
    dtype = getattr(torch, args.dtype)
    adapter = build_target(args.shape, args.layers, args.device, dtype, args.block_len, args.attention)
    vocab = adapter.info.vocab_size
    prompt = random_prompt(vocab, args.prompt_len)
    drafter = random_drafter(args.block_len, args.drafter_device)
    runs = [] if args.skip_decode else decode_shares(adapter, drafter, prompt, args.temps, args.budget, args.gen)
    out: dict[str, Any] = {
        "shape": args.shape, "layers": args.layers or SHAPES[args.shape]["num_hidden_layers"], "vocab": vocab,
        "dtype": args.dtype, "device": args.device, "drafter_device": args.drafter_device,
        "attention": args.attention, "block_len": args.block_len, "prompt_len": args.prompt_len,
        "gen": args.gen, "threads": torch.get_num_threads(), "runs": runs, "machine": machine(),
        "command": args.command,
    }
    if args.curve:
        out["forward_curve_s"], peak = forward_curve(adapter, prompt, list(range(1, 22)), args.repeats)
        if peak:
            out["forward_peak_mib"] = peak
    if args.memory:
        if adapter.device.type != "cpu":
            raise SystemExit("--memory measures the CPU allocator (on CUDA, --curve reports forward_peak_mib)")
        out["forward_peak_mib_cpu"] = memory_table(adapter, prompt)
    if args.invariance:
        out["batch_invariance"] = batch_invariance(adapter, prompt, list(range(1, args.invariance + 1)), args.trials)
    return out


# --- the device check (scripts/gpu_check.sh) ---

CHECK_PROMPTS = (256, 1024)
CHECK_INVARIANCE = [9, 21]
BENCH_CONFIGS = (("graph", 8), ("spot", 8), ("spot", 20))


def embedded_bench(device: str, n: int, temps: list[float], max_gen_toks: int, drafter_device: str,
                   seed: int = 0) -> dict[str, Any]:
    """`python -m research.bench --methods graph,spot --budgets 8,20` without lm-eval: the first n spot_arith
    test problems (regenerated from the task's seed: the same prompts as the task file), the embedded target,
    the shipped drafter and graph, paired timing as the bench does it (control before and after every sample,
    the configurations in an order rotated per sample). Accuracy: the answer after '#### ' against the
    problem's, which is what the task's strict-match filter and exact_match metric score here."""
    from lm_eval_spot.arith.generator import final_from_answer, make_prompt, make_split
    from lm_eval_spot.baselines.rank_graph import RankGraph
    from research.bench import Row, _timed
    from lm_eval_spot.settings.args import default_graph_path, default_target_path, drafter_for
    from lm_eval_spot.settings.cards import parse_model_args
    from lm_eval_spot.drafter.model import load_drafter
    from lm_eval_spot.families import load_target
    from lm_eval_spot.settings.proposers import MethodSpec, make_proposer
    from lm_eval_spot.harness.until import cut_text, make_stop_check

    raw = {"pretrained": str(default_target_path()), "device": device}
    loaded = load_target(parse_model_args({**raw, "mode": "control"}))
    adapter, tok = loaded.adapter, loaded.tokenizer
    drafter_path = drafter_for(parse_model_args({**raw, "mode": "spot"}))
    drafter = load_drafter(drafter_path, adapter.info.block_len)[0].to(drafter_device)
    graph = RankGraph.load(Path(default_graph_path()))
    proposers = {(m, D): make_proposer(MethodSpec(m, D), drafter, graph) for m, D in BENCH_CONFIGS}
    until = ["Q:", tok.eos_token]  # the task's generation_kwargs `until`, with the eos lm-eval appends
    decode_ids = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    stop = make_stop_check(decode_ids, until)
    problems = make_split("test", n)
    keys = list(proposers)
    rows = {(m, D, T): Row(m, D, T) for T in temps for m, D in [("control", "-"), *keys]}
    t_start = time.perf_counter()
    for i, prob in enumerate(problems):
        ids = tok(make_prompt(prob["question"]), add_special_tokens=False)["input_ids"]
        for T in temps:
            cfg = DecodeConfig(max_gen_toks=max_gen_toks, temperature=T, lookahead=True)

            def run(proposer: Any = None) -> Any:
                return decode(adapter, ids, cfg, seed * 1_000_003 + i, stop_check=stop, proposer=proposer)

            c1, c1_wall = _timed(run, 1)
            order = keys[i % len(keys):] + keys[: i % len(keys)]
            results = {k: _timed(lambda p=proposers[k]: run(p), 1) for k in order}
            _, c2_wall = _timed(run, 1)
            control_wall = (c1_wall + c2_wall) / 2
            for (m, D), (r, wall) in [(("control", "-"), (c1, control_wall)), *results.items()]:
                row = rows[(m, D, T)]
                text = cut_text(decode_ids(r.token_ids), until)
                row.nfe.append(r.nfe.total)
                row.control_nfe.append(c1.nfe.total)
                row.committed.append(r.committed)
                row.gen_tokens.append(len(r.token_ids))
                row.accepted.append(sum(r.accepted) / max(1, len(r.accepted)))
                row.correct.append(float(final_from_answer(text) == final_from_answer(prob["answer"])))
                row.exact.append(r.token_ids == c1.token_ids)
                row.ratio.append(control_wall / (c1.wall_s if m == "control" else wall))
                row.wall_s.append(wall)
                row.add_timing(r)
    summaries = [r.summary() for r in rows.values()]
    for s in summaries:
        log.info("bench %s D=%s T=%g: NFE %.1f (%.2fx fewer), throughput %.2fx control, exact %.3f, accuracy %.3f",
                 s["method"], s["budget"], s["temperature"], s["nfe_per_sample"], s["nfe_reduction"],
                 s["throughput_ratio"], s["exact_match_to_control"], s["accuracy"])
    return {"task": "spot_arith (test split, first n)", "n": n, "max_gen_toks": max_gen_toks, "temps": temps,
            "device": device, "drafter": str(drafter_path), "drafter_device": drafter_device,
            "dtype": str(next(adapter.model.parameters()).dtype).removeprefix("torch."),
            "wall_s": time.perf_counter() - t_start, "rows": summaries}


def _kernel_name(adapter: BlockCausalAdapter) -> str:
    """Which kernel the fused attention picked (fused, or math where the device's kernel is missing)."""
    from lm_eval_spot.adapters.cascade import pick_kernel

    p = next(adapter.model.parameters())
    cfg = adapter.model.config
    return pick_kernel(p.device, p.dtype, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)[1]


def check(args: argparse.Namespace) -> dict[str, Any]:
    """Every measurement of the device check. The JSON is rewritten after each section, so a run stopped by a
    time limit still leaves what it finished; a section that fails is recorded under "errors" and the others
    still run (a lent device's minutes are too few to rerun everything for one failure)."""
    t0 = time.perf_counter()
    quick = args.quick
    shape = args.shape or ("tiny" if quick else "sdar-1.7b")
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    vocab = SHAPES[shape].get("vocab_size", VOCAB)
    res: dict[str, Any] = {
        "check": "gpu_check", "quick": quick, "device": args.device, "command": args.command, "machine": machine(),
        "target": {"shape": shape, "layers": args.layers or SHAPES[shape]["num_hidden_layers"], "vocab": vocab,
                   "dtype": dtype_name, "block_len": args.block_len, "random_init": True},
        "drafter_device": args.drafter_device, "sections_s": {}, "errors": {},
    }
    state: dict[str, Any] = {}

    def build() -> None:
        model = build_model(shape, args.layers, args.device, getattr(torch, dtype_name))
        state["adapters"] = {a: make_adapter(model, args.block_len, a) for a in ATTENTIONS}
        res["target"]["fused_kernel"] = _kernel_name(state["adapters"]["fused"])

    def curve() -> None:
        times_ms: dict[str, dict[str, dict[int, float]]] = {}
        peaks: dict[str, dict[str, dict[int, float]]] = {}
        for P in CHECK_PROMPTS:
            prompt = random_prompt(vocab, P)
            for a, adapter in state["adapters"].items():
                times, peak = forward_curve(adapter, prompt, list(range(1, 22)), 1 if quick else args.repeats)
                times_ms.setdefault(str(P), {})[a] = {r: 1e3 * s for r, s in times.items()}
                if peak:
                    peaks.setdefault(str(P), {})[a] = peak
                log.info("t(R) P=%d %s: t(1) %.2f ms, t(9) %.2f ms, t(21) %.2f ms", P, a, 1e3 * times[1],
                         1e3 * times[9], 1e3 * times[21])
        res["forward_curve_ms"] = times_ms
        res["t21_over_t1"] = {P: {a: c[21] / c[1] for a, c in by_a.items()} for P, by_a in times_ms.items()}
        if peaks:
            res["forward_peak_mib"] = peaks

    def shares() -> None:
        drafter = random_drafter(args.block_len, args.drafter_device)
        temps = [0.0] if quick else [0.0, 1.0]
        res["decode"] = [run for P in CHECK_PROMPTS
                         for run in decode_shares(state["adapters"]["fused"], drafter, random_prompt(vocab, P),
                                                  temps, 8, 32 if quick else args.gen)]

    def invariance() -> None:
        res["batch_invariance"] = batch_invariance(state["adapters"]["fused"], random_prompt(vocab, 1024),
                                                   CHECK_INVARIANCE, 1 if quick else args.trials)

    def bench() -> None:
        state.clear()  # the 1.7B model's memory back before the embedded target loads
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        res["embedded_bench"] = embedded_bench(args.device, 2 if quick else args.bench_n, [0.0, 1.0],
                                               args.bench_max_gen_toks, args.drafter_device)

    sections = [("build", build), ("forward_curve", curve), ("decode", shares), ("batch_invariance", invariance),
                ("embedded_bench", bench)]
    for name, section in sections:
        if name not in ("build", "embedded_bench") and "adapters" not in state:
            continue  # no model (the build's error is recorded)
        t = time.perf_counter()
        try:
            section()
        except Exception as err:  # noqa: BLE001  (recorded in the JSON; the run goes on)
            log.exception("gpu_check: %s failed", name)
            res["errors"][name] = "".join(traceback.format_exception_only(type(err), err)).strip()
        res["sections_s"][name] = time.perf_counter() - t
        res["wall_s"] = time.perf_counter() - t0
        write_json(args.out, res)
        log.info("gpu_check: %s %s in %.1f s (%.1f s in all)", name, "FAILED" if name in res["errors"] else "done",
                 res["sections_s"][name], res["wall_s"])
    return res


def write_json(path: Path | None, res: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(path)  # whole files only, even if the run is killed mid-write


def markdown(res: dict[str, Any]) -> str:
    lines = ["| mode | T | replicas/round | rounds | bytes to host / round | wall s | forward s | drafting s | "
             "rest s | outside the forward |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['mode']} | {r['temperature']:g} | {r['replicas_per_round']:.1f} | {r['rounds']} | "
                     f"{r['host_bytes_per_round']:,.0f} | {r['wall_s']:.2f} | {r['forward_s']:.2f} | "
                     f"{r['draft_s']:.2f} | {r['rest_s']:.2f} | {100 * r['outside_share']:.1f}% |")
    if "batch_invariance" in res:
        inv = res["batch_invariance"]
        lines += ["", "| R | " + " | ".join(str(k) for k in inv) + " |", "|---|" + "---|" * len(inv),
                  "| max abs logit diff | " + " | ".join(f"{v['max_abs_logit_diff']:.2g}" for v in inv.values()) + " |",
                  "| transition flips / rows | " + " | ".join(f"{v['transition_flips']}/{v['rows']}"
                                                            for v in inv.values()) + " |"]
    if "forward_curve_s" in res:
        lines += ["", "| R | " + " | ".join(str(k) for k in res["forward_curve_s"]) + " |",
                  "|---|" + "---|" * len(res["forward_curve_s"]),
                  "| t(R) ms | " + " | ".join(f"{1e3 * v:.1f}" for v in res["forward_curve_s"].values()) + " |"]
    if "forward_peak_mib_cpu" in res:
        for what, mem in res["forward_peak_mib_cpu"].items():
            rs = list(next(iter(mem.values())))
            lines += ["", f"| peak MiB, {what.replace('_', ' ')} | " + " | ".join(f"R={r}" for r in rs) + " |",
                      "|---|" + "---|" * len(rs)]
            lines += [f"| {att} | " + " | ".join(f"{v:.1f}" for v in row.values()) + " |" for att, row in mem.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="default qwen3-small (--check: sdar-1.7b, or tiny with --quick)")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default float32 (--check: bfloat16 on CUDA)")
    ap.add_argument("--attention", default="fused", choices=ATTENTIONS, help="shared-prefix attention")
    ap.add_argument("--drafter-device", default="cpu", help="where the drafter runs (the host, as real runs do)")
    ap.add_argument("--block-len", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--gen", type=int, default=None, help="generated tokens per decode (default 32; --check: 64)")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--temps", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--curve", action="store_true", help="also time t(R) for R = 1..21")
    ap.add_argument("--memory", action="store_true",
                    help="CPU: peak memory of one forward at R = 1, 9, 21, fused and reference attention")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--invariance", type=int, default=0, metavar="MAX_R",
                    help="also measure batch-shape invariance for R = 1..MAX_R replicas")
    ap.add_argument("--trials", type=int, default=2, help="random replica sets per R (--invariance, --check)")
    ap.add_argument("--skip-decode", action="store_true", help="only the curve / invariance measurements")
    ap.add_argument("--check", action="store_true", help="the device check (scripts/gpu_check.sh): one JSON file")
    ap.add_argument("--quick", action="store_true", help="--check on a tiny shape with few repeats (CPU smoke run)")
    ap.add_argument("--bench-n", type=int, default=30, help="--check: embedded benchmark problems")
    ap.add_argument("--bench-max-gen-toks", type=int, default=96, help="--check: as the bench's --max-gen-toks")
    ap.add_argument("--out", type=Path, default=None, help="output folder (--check: the JSON file)")
    args = ap.parse_args(argv)
    args.command = "python -m research.scale_probe " + " ".join(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check:
        args.gen = args.gen or 64
        res = check(args)
        log.info("gpu_check: wrote %s (%.0f s)%s", args.out, res["wall_s"],
                 f"; FAILED: {', '.join(res['errors'])}" if res["errors"] else "")
        if res["errors"]:
            sys.exit(1)
        return
    args.gen = args.gen or 32
    args.dtype = args.dtype or "float32"
    args.shape = args.shape or "qwen3-small"
    res = probe(args)
    report(log, res, markdown(res), args.out, ("scale_probe.json", "scale_probe.md"))


if __name__ == "__main__":
    main()
