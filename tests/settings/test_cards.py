"""Every model card loads and validates; card=NAME fills defaults that explicit model args override."""

from __future__ import annotations

import pytest

from lm_eval_spot.settings.cards import card_names, cards_dir, load_card, validate
from lm_eval_spot.settings.cards import parse_model_args
from lm_eval_spot.settings.args import SpotArgError


def test_every_card_loads_and_validates():
    names = card_names()
    assert {"sdar-1.7b-chat", "sdar-4b-chat", "sdar-8b-chat", "llada2.0-mini", "llada-8b-instruct",
            "dream-v0-instruct-7b"} <= set(names)
    for size in ("1.7b", "4b", "8b"):
        for b in (8, 16, 32, 64):
            assert f"sdar-{size}-chat-b{b}" in names
    for name in names:
        card = load_card(name)
        assert card["block_len"] >= 1 and card["mask_id"] not in card["stop_ids"]
        bidirectional = card["family"] in ("llada", "dream")
        assert card["grid_origin"] == ("prompt_end" if bidirectional else "zero")


def test_block_variants_override_hub_id_and_block_length():
    card = load_card("sdar-8b-chat-b32")
    assert card["hub_id"] == "JetLM/SDAR-8B-Chat-b32" and card["block_len"] == 32 and card["family"] == "sdar"
    assert load_card("sdar-8b-chat")["block_len"] == 4


def test_card_fills_defaults_and_explicit_args_win():
    a = parse_model_args({"card": "sdar-1.7b-chat"})
    assert (a.pretrained, a.family, a.impl, a.block_len, a.mask_id, a.stop_ids, a.dtype) == (
        "JetLM/SDAR-1.7B-Chat", "sdar", "native", 4, 151669, (151645, 151643), "bfloat16")
    b = parse_model_args({"card": "sdar-1.7b-chat", "pretrained": "someone/SDAR-fork", "block_len": 8,
                    "dtype": "float32", "impl": "remote"})
    assert (b.pretrained, b.block_len, b.dtype, b.impl) == ("someone/SDAR-fork", 8, "float32", "remote")
    c = parse_model_args({"card": "llada2.0-mini"})
    assert c.trust_remote_code is False  # a card never runs a checkpoint's code on the user's behalf


def test_unknown_card_lists_the_known_ones():
    with pytest.raises(SpotArgError, match="card='sdar-99b' is not known; accepted: dream-v0-instruct-7b, "
                                           "llada-8b-instruct, llada2.0-mini, sdar-1.7b-chat"):
        parse_model_args({"card": "sdar-99b"})


def test_a_card_with_a_bad_field_is_refused():
    from lm_eval_spot.settings.cards import Card

    good = dict(load_card("sdar-4b-chat").fields)
    with pytest.raises(SpotArgError, match="block_len must be a positive integer"):
        validate(Card("x", {**good, "block_len": 0}))
    with pytest.raises(SpotArgError, match="stop_ids must contain eos_id"):
        validate(Card("x", {**good, "stop_ids": [151645]}))
    with pytest.raises(SpotArgError, match="family='nope' is not known"):
        validate(Card("x", {**good, "family": "nope"}))
    missing = {k: v for k, v in good.items() if k != "drafter"}
    with pytest.raises(SpotArgError, match="drafter missing"):
        validate(Card("x", missing))


def test_cards_ship_in_the_source_tree():
    assert (cards_dir() / "sdar-4b-chat.md").is_file()
