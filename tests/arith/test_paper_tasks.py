"""The paper-style plugin tasks (spot_gsm8k_chat, spot_humaneval_chat) through the real lm_eval CLI, offline from
../shared/data (the stock datasets, loaded the normal lm-eval way), with a chat template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.cli import LM_EVAL

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"
EMBEDDED = Path(__file__).resolve().parents[2] / "lm_eval_spot" / "assets" / "spot-arith-target"

pytestmark = pytest.mark.skipif(not (DATA / "openai" / "gsm8k").is_dir(), reason="../shared/data is absent (it is in CI)")


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory) -> Path:
    """The embedded target declaring a 2048-position context: HumanEval prompts (~830 tokens) exceed its real 512,
    which spot-dlm refuses. Positions past 512 are untrained; this test checks the task's plumbing, not answers."""
    out = tmp_path_factory.mktemp("long_ctx")
    for f in EMBEDDED.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The embedded target's tokenizer with a minimal chat template (it ships without one)."""
    out = tmp_path_factory.mktemp("chat_tok")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(EMBEDDED / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}A:{% endif %}")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.slow  # real lm_eval runs on the stock datasets (~25 s each); CI runs -m slow
@pytest.mark.parametrize("task,metric", [("spot_gsm8k_chat", "exact_match,strict-match"),
                                         ("spot_humaneval_chat", "pass_at_1,create_test")])
def test_paper_task_runs_offline_with_a_chat_template(long_context_target, chat_tokenizer, tmp_path, task, metric):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_ALLOW_CODE_EVAL": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [LM_EVAL, "--model", "spot-dlm", "--model_args", f"pretrained={long_context_target},tokenizer={chat_tokenizer},mode=spot,gen_length=32",
         "--tasks", task, "--limit", "2", "--device", "cpu", "--apply_chat_template", "--confirm_run_unsafe_code",
         "--log_samples", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=DATA, env=env, timeout=900)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    data = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    res = data["results"][task]
    assert metric in res and 0.0 <= res[metric] <= 1.0
    assert data["n-samples"][task]["effective"] == 2
    assert data["configs"][task]["num_fewshot"] == 0
    assert data["configs"][task]["generation_kwargs"]["max_gen_toks"] == 256  # the paper's length (gen_length=32 caps it)
    sample = json.loads(next((tmp_path / "out").rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()[0])
    assert sample["arguments"]["gen_args_0"]["arg_0"].startswith("Q: ")  # the chat template was applied
