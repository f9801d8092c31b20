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
