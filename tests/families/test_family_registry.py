"""Family detection, forced families, implementations, version gates, the SDAR config map and weight checks,
and interface-id resolution: every refusal is a one-line error naming what to do."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lm_eval_spot.settings.args import SpotArgError, parse_args
from lm_eval_spot.families import detect, load_target, names
from lm_eval_spot.families.sdar import qwen3_config

from helpers.remote_fixtures import SHARED, build_remote, needs_remote, needs_shared, save_checkpoint, tokenizer_mask_id


def shared_config(folder: str) -> dict:
    return json.loads((SHARED / folder / "config.json").read_text())


@needs_shared
@pytest.mark.parametrize("folder,family", [("sdar", "sdar"), ("llada2_moe", "llada2-moe"), ("llada", "llada"),
                                           ("dream", "dream")])
def test_families_are_detected_from_the_checkpoint_config(folder, family):
    assert detect(shared_config(folder), folder).name == family


def test_the_embedded_target_is_a_native_block_causal_lm():
    from lm_eval_spot.settings.args import default_target_path

    cfg = json.loads((default_target_path() / "config.json").read_text())
    assert detect(cfg, "embedded").name == "hf-block-causal"


def test_an_unknown_family_is_one_line_listing_the_supported_ones():
    with pytest.raises(SpotArgError) as err:
        detect({"model_type": "mamba_dlm", "architectures": ["MambaDLMForMaskedLM"]}, "/ckpt/mamba")
    msg = str(err.value)
    assert "\n" not in msg and "is not a supported family" in msg and "mamba_dlm" in msg
    assert all(n in msg for n in names()) and "Adding a target family" in msg and "family=NAME" in msg


def test_a_forced_unknown_family_is_refused(tmp_path):
    from lm_eval_spot.families import by_name

    with pytest.raises(SpotArgError, match="family='bogus' is not known; supported: sdar, llada2-moe, llada, dream, hf-block-causal"):
        by_name("bogus")


def test_impl_is_validated():
    with pytest.raises(SpotArgError, match="impl='fast' is not known; accepted: native, remote"):
        parse_args({"impl": "fast"})


@pytest.fixture(scope="module")
def sdar_dir(tmp_path_factory):
    if not SHARED.is_dir():
        pytest.skip("../shared is absent")
    if needs_remote.args[0]:
        pytest.skip("building the fixture needs the remote code (transformers 4.x)")
    return save_checkpoint(build_remote("sdar", mask_token_id=tokenizer_mask_id()), tmp_path_factory.mktemp("sdar"))


def test_llada2_has_no_native_path_and_remote_needs_trust(tmp_path):
    if not SHARED.is_dir():
        pytest.skip("../shared is absent")
    (tmp_path / "config.json").write_text(json.dumps(shared_config("llada2_moe")))
    with pytest.raises(SpotArgError, match="impl='native' is not available for family llada2-moe; accepted: remote"):
        load_target(parse_args({"pretrained": str(tmp_path), "impl": "native"}))
    with pytest.raises(SpotArgError, match="pass trust_remote_code=true"):
        load_target(parse_args({"pretrained": str(tmp_path)}))
    with pytest.raises(SpotArgError, match="attn_implementation='eager' is refused for LLaDA2.0-mini"):
        load_target(parse_args({"pretrained": str(tmp_path), "trust_remote_code": True, "attn_implementation": "eager"}))


def test_remote_under_transformers_5_stops_before_loading(sdar_dir, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    with pytest.raises(SpotArgError) as err:
        load_target(parse_args({"pretrained": str(sdar_dir), "impl": "remote", "trust_remote_code": True}))
    msg = str(err.value)
    assert "\n" not in msg and "transformers 5.24.0" in msg and "transformers==4.57.*" in msg


def test_sdar_config_fields_that_do_not_map_are_errors():
    if not SHARED.is_dir():
        pytest.skip("../shared is absent")
    cfg = shared_config("sdar")
    q = qwen3_config(cfg)
    theta = getattr(q, "rope_parameters", None) or {"rope_theta": q.rope_theta}  # 5.x moved it into rope_parameters
    assert (q.hidden_size, q.num_key_value_heads, q.head_dim, theta["rope_theta"]) == (64, 2, 16, 1000000)
    assert q.use_sliding_window is False and q.tie_word_embeddings is False
    with pytest.raises(SpotArgError, match="cannot map SDAR config field\\(s\\) moe_experts onto Qwen3"):
        qwen3_config({**cfg, "moe_experts": 8})


def test_sdar_weights_that_do_not_map_are_errors(sdar_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(sdar_dir, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = weights.pop("model.layers.0.self_attn.q_norm.weight")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpotArgError) as err:
        load_target(parse_args({"pretrained": str(broken), "mode": "control"}))
    msg = str(err.value)
    assert "do not map onto Qwen3" in msg and "q_norm" in msg and "extra" in msg


def test_mask_ids_that_disagree_need_an_explicit_choice(sdar_dir, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(sdar_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["mask_token_id"] = 300
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SpotArgError, match="mask_token_id=300 but its tokenizer's mask token is id"):
        load_target(parse_args({"pretrained": str(other), "mode": "control"}))
    loaded = load_target(parse_args({"pretrained": str(other), "mode": "control", "mask_id": 300,
                                     "stop_ids": "0|5"}))
    assert loaded.adapter.info.mask_id == 300 and loaded.adapter.info.stop_ids == frozenset({0, 5})


def test_a_folder_without_a_tokenizer_is_a_clear_error(sdar_dir, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(sdar_dir, bare)
    for f in bare.glob("tokenizer*"):
        f.unlink()
    (bare / "special_tokens_map.json").unlink()
    with pytest.raises(SpotArgError, match="no tokenizer could be loaded"):
        load_target(parse_args({"pretrained": str(bare), "mode": "control"}))


@needs_shared
@pytest.mark.parametrize("T", [0.0, 1.0])
def test_sdar_native_path_without_any_remote_code(tmp_path, T):
    """An SDAR-format checkpoint (SDAR's config.json, weights under SDAR's names) written WITHOUT the remote code,
    so this also runs under transformers 5.x: the native path decodes exactly what a naive decoder recomputing the
    whole sequence through transformers' stock Qwen3 forward gives."""
    import shutil

    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from helpers.reference import reference_decode
    from helpers.remote_fixtures import TOKENIZER, TOKENIZER_FILES

    cfg = {**shared_config("sdar"), "mask_token_id": tokenizer_mask_id()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(3)
    ref_model = Qwen3ForCausalLM(Qwen3Config(**{k: cfg[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings")},
        tie_word_embeddings=False)).eval()
    save_file({k: v.contiguous() for k, v in ref_model.state_dict().items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, tmp_path / name)
    loaded = load_target(parse_args({"pretrained": str(tmp_path), "mode": "control"}))
    assert (loaded.family, loaded.impl, loaded.adapter.info.block_len) == ("sdar", "native", 4)
    info = loaded.adapter.info
    for prompt in ([9, 10, 11], list(range(30, 39))):
        got = decode(loaded.adapter, prompt, DecodeConfig(max_gen_toks=13, temperature=T), seed=2)
        ref, _ = reference_decode(ref_model, prompt, 4, info.mask_id, set(info.stop_ids), 13, T, seed=2)
        assert got.token_ids == ref


@needs_shared
@pytest.mark.parametrize("fam", ["llada", "dream"])
def test_bidirectional_native_paths_without_any_remote_code(tmp_path, fam):
    """LLaDA / Dream checkpoints (their config.json, weights under their own names) written WITHOUT the remote code,
    so this also runs under transformers 5.x: block logits equal a whole-canvas forward of transformers' stock
    class with an all-zero 4D mask (Dream's realigned by one), and SPOT equals control."""
    import shutil

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from lm_eval_spot.decoding.loop import DecodeConfig, decode
    from lm_eval_spot.drafter.factored import FactoredConfig, FactoredOrderModel
    from lm_eval_spot.drafter.spot_proposer import LearnedOrder, TreeConfig, TreeProposer
    from helpers.remote_fixtures import TOKENIZER, TOKENIZER_FILES

    mask = tokenizer_mask_id()
    cfg = {**shared_config(fam), "mask_token_id": mask}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    torch.manual_seed(4)
    if fam == "dream":
        ref = Qwen2ForCausalLM(Qwen2Config(**{k: cfg[k] for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings")})).eval()
        weights = dict(ref.state_dict())
    else:
        ref = LlamaForCausalLM(LlamaConfig(vocab_size=cfg["embedding_size"], hidden_size=cfg["d_model"],
                                           intermediate_size=cfg["mlp_hidden_size"], num_hidden_layers=cfg["n_layers"],
                                           num_attention_heads=cfg["n_heads"], num_key_value_heads=cfg["n_kv_heads"],
                                           rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg["rope_theta"])).eval()
        names = {"self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
                 "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj",
                 "mlp.down_proj": "ff_out", "input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm"}
        weights = {}
        for k, v in ref.state_dict().items():  # Llama names -> LLaDA's own (written here, independently)
            if k.startswith("model.layers."):
                i, rest = k[len("model.layers."):].split(".", 1)
                sub, leaf = rest.rsplit(".", 1)
                weights[f"model.transformer.blocks.{i}.{names[sub]}.{leaf}"] = v
            else:
                weights[{"model.embed_tokens.weight": "model.transformer.wte.weight", "model.norm.weight":
                         "model.transformer.ln_f.weight", "lm_head.weight": "model.transformer.ff_out.weight"}[k]] = v
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, tmp_path / name)
    loaded = load_target(parse_args({"pretrained": str(tmp_path), "mode": "control", "block_len": 4}))
    assert (loaded.family, loaded.impl, loaded.adapter.info.grid_origin) == (fam, "native", "prompt_end")
    ad = loaded.adapter
    prompt = [9, 10, 11, 12, 13]
    session, _ = ad.open(prompt, 8)
    st = torch.tensor([[mask, 40, mask, mask], [41, 42, mask, 43]])
    got = session.block_logits(st)
    canvas = torch.cat([torch.tensor(prompt).expand(2, -1), st, torch.full((2, 4), mask)], 1)
    with torch.no_grad():
        raw = ref(input_ids=canvas, attention_mask=torch.zeros(2, 1, 13, 13)).logits
    want = raw[:, 4:8] if fam == "dream" else raw[:, 5:9]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    torch.manual_seed(0)
    prop = TreeProposer(LearnedOrder(FactoredOrderModel(FactoredConfig())), TreeConfig(budget=4))
    for T in (0.0, 1.0):
        cfg_ = DecodeConfig(max_gen_toks=10, temperature=T)
        assert decode(ad, prompt, cfg_, seed=3, proposer=prop).token_ids == decode(ad, prompt, cfg_, seed=3).token_ids
