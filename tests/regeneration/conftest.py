"""Fixtures of the regeneration tests."""

from __future__ import annotations

import pytest

from tests.tokenizer_fixture import make_chat_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    make_chat_tokenizer().save_pretrained(directory)
    return directory
