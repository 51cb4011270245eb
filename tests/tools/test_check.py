"""`python -m lm_eval_spot.tools.check` on the embedded target (the real CLI) and on every fixture family, and a
deliberately broken adapter that it must catch (non-zero exit, the failing row named)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lm_eval_spot.tools import check

from helpers.remote_fixtures import add_test_stubs, build_remote, needs_remote, save_checkpoint, tokenizer_mask_id


def test_check_cli_passes_on_the_embedded_target(tmp_path):
    out = subprocess.run([sys.executable, "-m", "lm_eval_spot.tools.check", "--out", str(tmp_path / "c.json"),
                          "--max-gen-toks", "24"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "all checks passed" in out.stdout and "| SPOT == control, T=1" in out.stdout
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["passed"] and data["target"]["family"] == "hf-block-causal"
    status = {r["name"]: r["status"] for r in data["rows"]}
    assert status["cache == full recomputation"] == "pass" and status["SPOT == control, T=0"] == "pass"


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    if not check_remote_available():
        pytest.skip("remote code fixtures need ../shared and transformers 4.x")
    add_test_stubs()
    root = tmp_path_factory.mktemp("check")
    save_checkpoint(build_remote("sdar", mask_token_id=tokenizer_mask_id()), root / "sdar")
    save_checkpoint(build_remote("llada2_moe", seed=1), root / "llada2")
    from helpers.targets import build

    for fam in ("llada", "dream"):
        save_checkpoint(build(fam, tokenizer_mask_id()), root / fam)
    return root


def check_remote_available() -> bool:
    return not needs_remote.args[0]


CASES = {
    "sdar-native": ("sdar", "trust_remote_code=true", {"native vs remote": "pass"}),
    "sdar-remote": ("sdar", "impl=remote,trust_remote_code=true", {"native vs remote": "pass"}),
    "llada2-fp32": ("llada2", "trust_remote_code=true,block_len=8", {"control == official generation": "skip"}),
    "llada2-bf16": ("llada2", "trust_remote_code=true,block_len=8,dtype=bfloat16",
                    {"control == official generation": "pass"}),
    "llada-native": ("llada", "trust_remote_code=true,block_len=4", {"native vs remote": "pass"}),
    "llada-remote": ("llada", "impl=remote,trust_remote_code=true,block_len=4", {"native vs remote": "pass"}),
    "llada-approx": ("llada", "cache=approx,trust_remote_code=true,block_len=4",
                     {"cache == full recomputation": "warn", "native vs remote": "pass"}),
    "dream-native": ("dream", "trust_remote_code=true,block_len=4", {"native vs remote": "pass"}),
    "dream-remote": ("dream", "impl=remote,trust_remote_code=true,block_len=4",
                     {"control == official generation": "pass"}),
    "dream-approx": ("dream", "cache=approx,block_len=4", {"cache == full recomputation": "warn"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_check_passes_on_every_fixture_family(fixtures, tmp_path, case, capsys):
    folder, extra, expect = CASES[case]
    code = check.main(["--model_args", f"pretrained={fixtures / folder},{extra}", "--out", str(tmp_path / "c.json"),
                       "--max-gen-toks", "16", "--prompt", "Q: 1+2+3-4+5\nA:", "--prompt", "Q: 9-8+7\nA: Step"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    data = json.loads((tmp_path / "c.json").read_text())
    status = {r["name"]: r["status"] for r in data["rows"]}
    for name in ("cache == full recomputation", "pure (prefix unchanged by replica forwards)",
                 "SPOT == control, T=0", "SPOT == control, T=1"):
        assert status[name] == expect.get(name, "pass"), printed
    for name, want in expect.items():
        assert status[name] == want, printed


def test_check_fails_on_an_adapter_that_inverts_the_mask(fixtures, tmp_path, monkeypatch, capsys):
    """The bug the SDAR family had before it had an adapter: an additive 0/-inf mask handed to SDAR's forward,
    which reads masks with .bool() and so inverts it. Broken here on the cached path only: the self-check's
    cache-free reference must disagree with it."""
    from lm_eval_spot.families import sdar

    real = sdar.SDARProtocol.forward

    def additive_when_cached(self, model, ids, positions, allowed, cache, store, keep):
        if cache is None:
            return real(self, model, ids, positions, allowed, cache, store, keep)
        additive = torch.zeros(allowed.shape, dtype=model.dtype).masked_fill(~allowed, float("-inf"))
        kw = {"past_key_values": cache, "use_cache": True, "store_kv": store}
        return model(input_ids=ids, attention_mask=additive.unsqueeze(1), position_ids=positions, **kw).logits[:, -keep:]

    monkeypatch.setattr(sdar.SDARProtocol, "forward", additive_when_cached)
    code = check.main(["--model_args", f"pretrained={fixtures / 'sdar'},impl=remote,trust_remote_code=true",
                       "--out", str(tmp_path / "c.json"), "--max-gen-toks", "8", "--prompt", "Q: 1+2+3-4+5\nA:"])
    printed = capsys.readouterr().out
    assert code == 1
    assert "FAILED: cache == full recomputation" in printed
    data = json.loads((tmp_path / "c.json").read_text())
    assert not data["passed"]
    assert {r["name"]: r["status"] for r in data["rows"]}["cache == full recomputation"] == "fail"
