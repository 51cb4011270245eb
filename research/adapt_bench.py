"""Online adaptation against its references, through the real `spot-dlm` model class, one process:

    python -m research.adapt_bench --target runs/b8/final --own runs/b8_drafter/drafter --n 500

For each temperature, the task's first N requests (default spot_arith) are decoded in order by fresh `spot-dlm`
instances: SPOT with the transfer drafter adapting online (paired with control: exact match counted), the same
with adapt=off, SPOT with the target's own drafter (adapt=off), and conf-tree. Reported per configuration: NFE
per sample over all requests and over the last `--last`, NFE by tenth of the run, the method's own decoding
time (adaptation included), and for the adapting run its examples, steps and share of the time. NFE does not
depend on timing; the times do (run it alone: `OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("research.adapt_bench")


def _requests(task: str, n: int, temperature: float, num_fewshot: int | None = None) -> list[Any]:
    from lm_eval.api.instance import Instance

    from lm_eval_spot.training.prompts import TaskSource

    src = TaskSource(task, n, num_fewshot=num_fewshot)
    out = []
    for inst in src.instances:
        kw = dict(inst.args[1])
        if temperature > 0:
            kw.update(do_sample=True, temperature=temperature)
        out.append(Instance("generate_until", inst.doc, (inst.args[0], kw), inst.idx,
                            metadata=(inst.task_name, inst.doc_id, inst.repeats)))
    return out


def run_config(name: str, model_args: dict[str, Any], requests: list[Any], last: int) -> dict[str, Any]:
    from lm_eval_spot.harness.model import SpotDLM
    from lm_eval_spot.reports.run_stats import nfe_by_tenth

    t0 = time.perf_counter()
    lm = SpotDLM(**model_args)
    lm.generate_until(requests, disable_tqdm=True)
    spot = lm.get_model_info()["spot"]
    nfe = [s.nfe for s in lm.generation.stats.samples]
    row = {"config": name, "model_args": {k: str(v) for k, v in model_args.items()},
           "nfe_per_sample": statistics.mean(nfe), f"nfe_last_{last}": statistics.mean(nfe[-last:]),
           "nfe_by_tenth": [round(x, 2) for x in nfe_by_tenth(nfe)], "decode_wall_s": spot["decode_wall_s"],
           "process_s": time.perf_counter() - t0, "exact_match_to_control": spot.get("exact_match_to_control"),
           "nfe": nfe}
    if "adapt" in spot:
        a = spot["adapt"]
        row["adapt"] = {k: a[k] for k in ("examples", "update_steps", "seconds", "recording_s", "share_of_wall")}
    log.info("%s: NFE/sample %.2f, last %d %.2f, decode %.1f s%s", name, row["nfe_per_sample"], last,
             row[f"nfe_last_{last}"], row["decode_wall_s"],
             f", adapt {100 * row['adapt']['share_of_wall']:.1f}%" if "adapt" in row else "")
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--own", help="the target's own drafter folder (python -m lm_eval_spot.training all)")
    ap.add_argument("--task", default="spot_arith")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--last", type=int, default=200)
    ap.add_argument("--temps", default="0,1")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--max-gen-toks", type=int, default=None, help="gen_length cap (e8c: 80, its canvas)")
    ap.add_argument("--configs", default="adapt,off,own,conf-tree")
    ap.add_argument("--model-args", default="", help="extra spot-dlm model args k=v,... for every configuration")
    ap.add_argument("--num-fewshot", type=int, default=None, help="as lm_eval's (default: the task's)")
    ap.add_argument("--data-dir", type=Path, default=None,
                    help="run a stock task offline from staged datasets (e.g. ../shared/data: gsm8k)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    if args.data_dir is not None:  # stock tasks name their dataset by a path relative to the working directory
        os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        args.target = str(Path(args.target).resolve()) if Path(args.target).exists() else args.target
        args.own = str(Path(args.own).resolve()) if args.own else None
        os.chdir(args.data_dir)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("lm_eval", "lm_eval.spot"):
        logging.getLogger(name).setLevel(logging.WARNING)
    extra = dict(kv.split("=", 1) for kv in args.model_args.split(",") if kv)
    base = {"pretrained": args.target, "budget": args.budget, "batch_size": args.batch_size, "seed": 0,
            "threads": 1, **({"gen_length": args.max_gen_toks} if args.max_gen_toks else {}), **extra}
    configs = {
        "adapt": {**base, "mode": "spot", "adapt": "online", "control": "paired"},
        "off": {**base, "mode": "spot", "adapt": "off"},
        "own": {**base, "mode": "spot", "adapt": "off", "drafter": args.own},
        "conf-tree": {**base, "mode": "conf-tree"},
    }
    picked = [c for c in args.configs.split(",") if c and (c != "own" or args.own)]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"target": args.target, "n": args.n, "last": args.last, "rows": []}
    for T in (float(t) for t in args.temps.split(",")):
        requests = _requests(args.task, args.n, T, args.num_fewshot)
        for name in picked:
            row = run_config(name, configs[name], requests, args.last)
            row["temperature"] = T
            results["rows"].append(row)
            (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "table.md").write_text(table(results) + "\n")
    print(table(results))


def table(results: dict[str, Any]) -> str:
    last = results["last"]
    lines = [f"| T | config | NFE/sample | NFE last {last} | vs own (last {last}) | vs conf-tree (last {last}) | "
             "decode s | adapt share | exact | NFE by tenth |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        same = [x for x in results["rows"] if x["temperature"] == r["temperature"]]
        ref = {x["config"]: x[f"nfe_last_{last}"] for x in same}
        own = f"{r[f'nfe_last_{last}'] / ref['own']:.3f}" if "own" in ref else ""
        ct = f"{r[f'nfe_last_{last}'] / ref['conf-tree']:.3f}" if "conf-tree" in ref else ""
        share = f"{100 * r['adapt']['share_of_wall']:.1f}%" if r.get("adapt") else ""
        exact = "" if r.get("exact_match_to_control") is None else f"{r['exact_match_to_control']:.3f}"
        lines.append(f"| {r['temperature']:g} | {r['config']} | {r['nfe_per_sample']:.2f} | {r[f'nfe_last_{last}']:.2f} "
                     f"| {own} | {ct} | {r['decode_wall_s']:.1f} | {share} | {exact} | "
                     f"{' '.join(f'{x:.1f}' for x in r['nfe_by_tenth'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
