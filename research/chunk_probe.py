"""Chunked against continuous batching, in one process, on a text target (issue 51 diagnosis, stop 57).

    python research/chunk_probe.py [TARGET]   # TARGET: /work/runs/nl4/final unless given; reads ../shared/data

Chunked: 48 GSM8K test prompts decoded 8 at a time, a chunk waiting for its longest request (what the runner does
today); continuous: all 48 given to decode_many with batch_size 8, a finished request replaced by the next.
Control and the default (budget=auto, the run's drafter), A B B A."""

import json
import sys
import time
from pathlib import Path

import torch
from lm_eval_spot.harness.model import SpotDLM
from lm_eval_spot.decoding.batch import DecodeRequest, decode_many
from lm_eval_spot.decoding.loop import DecodeConfig


def main() -> None:
    torch.set_num_threads(1)
    qs=[json.loads(l)["question"] for l in open(Path(__file__).resolve().parents[2] / 'shared/data/openai/gsm8k/main/test.jsonl')][:48]
    lm=SpotDLM(pretrained=sys.argv[1] if len(sys.argv) > 1 else '/work/runs/nl4/final', batch_size=8)
    tok=lm.tokenizer
    ids=[tok.encode(f"Question: {q}\nAnswer:", add_special_tokens=False) for q in qs]
    cfg=DecodeConfig(max_gen_toks=256, temperature=0.0)
    setup=lm.generation.setup
    prop=setup.proposers.for_chunk(1, None)[0]
    def run(drafting, continuous):
        jobs=[DecodeRequest(list(p), cfg, i, None, prop if drafting else None) for i,p in enumerate(ids)]
        pol=setup.policy if drafting else None
        t=time.perf_counter()
        if continuous:
            res=decode_many(setup.adapter, jobs, batch_size=8, policy=pol)
        else:
            res=[]
            for k in range(0,len(jobs),8): res+=decode_many(setup.adapter, jobs[k:k+8], batch_size=8, policy=pol)
        w=time.perf_counter()-t
        toks=sum(len(r.token_ids) for r in res); nfe=sum(r.nfe.total for r in res)/len(res)
        return w, toks/w, nfe, [r.token_ids for r in res]
    out={}
    for rep in range(2):
        for key in ([(False,False),(True,False),(False,True),(True,True)] if rep==0 else [(True,True),(False,True),(True,False),(False,False)]):
            w,tps,nfe,t=run(*key); out.setdefault(key,[]).append((tps,nfe,t))
            print(("spot" if key[0] else "control"), ("continuous" if key[1] else "chunked"), f"{tps:.1f} tok/s NFE {nfe:.1f}", flush=True)
    for c in (False,True):
        cs=sum(x[0] for x in out[(False,c)])/2; ss=sum(x[0] for x in out[(True,c)])/2
        same=out[(False,c)][0][2]==out[(True,c)][0][2]
        print("continuous" if c else "chunked", f"default/control {ss/cs:.3f}", "identical", same)


if __name__ == "__main__":
    main()
