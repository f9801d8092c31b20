"""The method registry (design §18): each name gives its object, an unknown one a clear error."""

import pytest

from dflash_jax.methods import METHODS, method_for


def test_each_name_gives_its_method():
    assert sorted(METHODS) == ["dflash", "dflash2", "dspark"]
    for name, method in METHODS.items():
        assert method_for(name) is method and method.name == name


def test_unknown_name_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown drafter method 'eagle': expected one of dflash, dspark, dflash2"):
        method_for("eagle")


def test_dspark_alone_drafts_the_anchor_slot():
    assert [(name, m.first_slot, m.draft_length(16)) for name, m in METHODS.items()] == [
        ("dflash", 1, 15), ("dspark", 0, 16), ("dflash2", 1, 15)]


def test_each_method_fills_its_model_card_text_from_the_config():
    """The card's summary names the tokens a block drafts and the rows give the method's own fields, read from
    the drafter config (weights/model_card.py places them)."""
    from types import SimpleNamespace

    config = SimpleNamespace(block_size=16, markov_rank=8, conv_kernel_size=2, conv_group_size=16, selector_rank=32,
                             selector_top_k=4)
    texts = {name: method.card_text(config) for name, method in METHODS.items()}
    assert "drafts\n15 tokens" in texts["dflash"][0] and texts["dflash"][1] == []
    assert "drafts 16 tokens" in texts["dspark"][0] and texts["dspark"][1] == [("Markov rank", "8")]
    assert "among the 4 most likely" in texts["dflash2"][0]
    assert texts["dflash2"][1] == [("convolution taps / group", "2 / 16"), ("selector rank / candidates", "32 / 4")]
    assert {method.export_layout for method in METHODS.values()} == {"z-lab", "speculators dspark", "z-lab dflash2"}
