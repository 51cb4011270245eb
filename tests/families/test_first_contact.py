"""Issue 31: a new user's first run on a real checkpoint. lm-eval's own arguments next to --model_args, one-line
input errors, ids the tokenizer does not know, stop ids and chat templates from the hub files, the self-check's
near-ties. Real-file checkpoints come from tests/helpers/real_files.py (../shared/real_checkpoints)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance

from lm_eval_spot.settings.args import merge_harness_args
from lm_eval_spot.harness.model import SpotDLM

from helpers.real_files import REAL, build, needs_real
from helpers.cli import LM_EVAL

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
ENV = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def cli(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([LM_EVAL, *args], capture_output=True, text=True, cwd=cwd, env={**ENV, **env}, timeout=900)


def req(context: str, **gen) -> Instance:
    gen.setdefault("until", ["\n\n"])
    return Instance("generate_until", {}, (context, gen), 0)


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    if not REAL.is_dir():
        pytest.skip("../shared/real_checkpoints is absent (it is in CI)")
    root = tmp_path_factory.mktemp("real")
    return {n: build(n, root / n, layers=1) for n in ("dream-v0-instruct-7b", "llada-8b-instruct", "sdar-1.7b-chat")}


def test_model_args_win_over_harness_args_with_a_note():
    merged, notes = merge_harness_args({"device": "cpu", "budget": "4"},
                                       {"device": "cuda:0", "batch_size": 1, "max_batch_size": None})
    assert merged == {"device": "cpu", "budget": "4", "batch_size": 1}
    assert notes == ["device='cpu' from --model_args wins over lm-eval's device='cuda:0'"]
    assert merge_harness_args({"device": "cpu"}, {"device": "cpu"}) == ({"device": "cpu"}, [])


@pytest.mark.parametrize("flags", [[], pytest.param(["--device", "cpu", "--batch_size", "2"], marks=pytest.mark.slow)])
def test_device_and_batch_size_in_model_args_through_the_cli(tiny_target_dir, tmp_path, flags):
    out = cli(["--model", "spot-dlm", "--model_args", f"pretrained={tiny_target_dir},mode=control,device=cpu,"
               "batch_size=2", "--tasks", "spot_arith_mini", "--limit", "2", "--gen_kwargs", "max_gen_toks=8", *flags],
              tmp_path)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "got multiple values" not in log and "spot-dlm run summary" in log
    if not flags:  # lm-eval passed its default device and batch size: the model args won, and the log says so
        assert "device='cpu' from --model_args wins over lm-eval's device='cuda:0'" in log


def test_bad_model_arg_is_one_line_and_exit_2(tmp_path):
    out = cli(["--model", "spot-dlm", "--model_args", "budget=banana", "--tasks", "spot_arith"], tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "budget='banana' is not an integer; accepted: integers >= 1" in errors[0]


@pytest.mark.slow
def test_spot_debug_keeps_the_traceback(tmp_path):
    debug = cli(["--model", "spot-dlm", "--model_args", "budget=banana", "--tasks", "spot_arith"], tmp_path,
                SPOT_DEBUG="1")
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "SpotArgError" in debug.stderr


def _force(lm: SpotDLM, token: int, positions: slice = slice(None)) -> torch.utils.hooks.RemovableHandle:
    """Make the target's logits prefer `token` (at the given canvas positions) by a wide margin."""
    def hook(module, args, out):
        out.logits[:, positions, token] = out.logits.abs().amax() * 4 + 100
    return lm.adapter.model.register_forward_hook(hook)


@needs_real
@pytest.mark.parametrize("name,eot,eos", [("llada-8b-instruct", 126348, 126081),
                                          ("dream-v0-instruct-7b", 151645, 151643)])
def test_no_card_stops_at_the_chat_templates_end_of_turn(real, name, eot, eos):
    lm = SpotDLM(pretrained=str(real[name]), mode="control", seed=0)
    assert {eot, eos} <= set(lm.adapter.info.stop_ids)
    handle = _force(lm, eot)
    try:
        out = lm.generate_until([req("Hi", max_gen_toks=16, until=[])])
    finally:
        handle.remove()
    assert out == [""] and lm.generation.stats.samples[-1].stop_reason == "eos" and lm.generation.stats.samples[-1].gen_tokens == 0


@needs_real
def test_an_id_beyond_the_tokenizer_decodes_and_is_counted(real):
    from transformers import Qwen2Tokenizer

    path = real["dream-v0-instruct-7b"]
    beyond = 152000  # the head has 152,064 rows, the tokenizer 151,667 tokens
    slow = Qwen2Tokenizer.from_pretrained(path)  # a slow (Python) tokenizer under transformers 4.x
    if not slow.is_fast:
        with pytest.raises(TypeError):  # what crashed a 602 s run: the slow tokenizer joins a None
            slow.decode([9707, beyond])
    for mode in ("control", "spot"):
        lm = SpotDLM(pretrained=str(path), mode=mode, seed=0)
        handle = _force(lm, beyond)
        try:
            out = lm.generate_until([req("Hi", max_gen_toks=8, until=["\n\n"])])
        finally:
            handle.remove()
        assert out == [""]
        summary = lm.get_model_info()["spot"]
        assert summary["unknown_token_ids"] == 8 and lm.generation.sample_log[-1]["unknown_ids"] == 8
    from lm_eval_spot.tokens import TextDecoder

    dec = TextDecoder.for_target(slow, 152064)  # the slow tokenizer too
    assert beyond in dec.unknown and dec([9707, beyond]) == slow.decode([9707])


@pytest.mark.slow
@needs_real
def test_gsm8k_with_the_chat_template_through_the_cli(real, tmp_path):
    if not (DATA / "openai" / "gsm8k").exists() and not (DATA / "gsm8k").exists():
        pytest.skip("../shared/data has no gsm8k")
    from transformers import Qwen2TokenizerFast

    path = real["dream-v0-instruct-7b"]
    out = cli(["--model", "spot-dlm", "--model_args", f"pretrained={path},mode=control,device=cpu", "--tasks", "gsm8k",
               "--limit", "2", "--num_fewshot", "0", "--apply_chat_template", "--gen_kwargs", "max_gen_toks=8",
               "--output_path", str(tmp_path / "out"), "--log_samples"], DATA)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert "151645 '<|im_end|>' (chat template end of turn)" in log
    data = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    template = Qwen2TokenizerFast.from_pretrained(path).chat_template
    assert data["chat_template"] == template
    assert data["chat_template_sha"] == hashlib.sha256(template.encode()).hexdigest()
    tok = Qwen2TokenizerFast.from_pretrained(path)
    for line in next((tmp_path / "out").rglob("samples_gsm8k_*.jsonl")).read_text().splitlines():
        sample = json.loads(line)
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        user = f"Question: {sample['doc']['question']}\nAnswer:"
        assert prompt == tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                                 add_generation_prompt=True)


@needs_real
def test_self_check_in_bf16_warns_on_near_ties_only(real, tmp_path):
    """SDAR-1.7B's card runs bf16, where the cached and the recomputed logits differ by rounding: ties at the top
    may flip. Those are warnings with their margins; the run passes (exit 0)."""
    proc = subprocess.run([sys.executable, "-m", "lm_eval_spot.tools.check", "--model_args",
                           f"pretrained={real['sdar-1.7b-chat']},card=sdar-1.7b-chat", "--device", "cpu",
                           "--max-gen-toks", "8", "--out", str(tmp_path / "c.json")],
                          capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    cache = rows["cache == full recomputation"]
    assert cache["numbers"]["argmax_flips"] == 0 and cache["numbers"]["of_tolerance"] <= 1.0
    assert cache["status"] == ("warn" if cache["numbers"]["near_tie_flips"] else "pass")
    assert all(m < 1.0 for m in cache["numbers"]["near_tie_margins_of_tolerance"])


def test_near_tie_flips_are_told_apart_from_real_ones():
    from lm_eval_spot.tools.check import _flip_margins

    ref = torch.tensor([[[5.0, 4.99, 0.0], [5.0, 1.0, 0.0]]])
    out = torch.tensor([[[4.98, 5.0, 0.0], [1.0, 5.0, 0.0]]])  # both positions flip: by 0.01 and by 4.0
    assert [round(m, 4) for m in _flip_margins(out, ref)] == [0.01, 4.0]
    assert _flip_margins(ref, ref) == []


@pytest.mark.slow
@needs_real
def test_self_check_with_impl_remote_on_dream_compares_both(real, tmp_path):
    """The README's Dream self-check command (impl=remote): it used to stop building the native side on the hub
    config's use_mrope. The official code is copied next to the weights as a hub download has it (test-only);
    tokenization_dream.py is not staged, so the tokenizer comes from a copy whose config names transformers'
    Qwen2 class (the same files)."""
    import shutil

    from helpers.remote_fixtures import SHARED, transformers_major

    if not SHARED.is_dir() or transformers_major() >= 5:
        pytest.skip("the official remote code runs only under transformers 4.x (and ../shared must be present)")
    folder = tmp_path / "dream"
    shutil.copytree(real["dream-v0-instruct-7b"], folder)
    for f in (SHARED / "dream").glob("*.py"):
        shutil.copy(f, folder / f.name)
    tok = tmp_path / "tok"
    shutil.copytree(real["dream-v0-instruct-7b"], tok, ignore=shutil.ignore_patterns("*.safetensors*"))
    tc = json.loads((tok / "tokenizer_config.json").read_text())
    tc.pop("auto_map")
    tc["tokenizer_class"] = "Qwen2Tokenizer"
    (tok / "tokenizer_config.json").write_text(json.dumps(tc))
    proc = subprocess.run([sys.executable, "-m", "lm_eval_spot.tools.check", "--model_args",
                           f"card=dream-v0-instruct-7b,pretrained={folder},tokenizer={tok},impl=remote,"
                           "trust_remote_code=true", "--device", "cpu", "--max-gen-toks", "8",
                           "--out", str(tmp_path / "c.json")], capture_output=True, text=True, env=ENV, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["name"]: r for r in json.loads((tmp_path / "c.json").read_text())["rows"]}
    assert rows["native vs remote"]["status"] == "pass", rows["native vs remote"]
