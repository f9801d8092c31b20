"""startup.settle (design §7): the run's config filled in once, in one place, and frozen; the caller's left as given."""

from __future__ import annotations

import jax
import pytest
from etils import epath
from transformers import AutoTokenizer

from dflash_jax.train import epochs, startup, validate
from tests.train_fixtures import TARGET_VOCAB, make_target, tiny_config, write_corpus


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("settle")
    return make_target(root / "target"), write_corpus(root / "train.jsonl", count=40)


@pytest.mark.parametrize("layout, settled_layout", [("tensor", "tensor"), ("auto", "fsdp")])
def test_settle_fills_in_every_derived_field_and_freezes_the_config(files, tmp_path, layout, settled_layout):
    """On CPU devices (no memory reported, so no plan): a given layout is kept and "auto" is fsdp's; the batch is
    rows_per_device x the mesh's data x fsdp devices; the mask token is the tokenizer's resolution; the schedule's
    length comes from config.epochs over the corpus."""
    given = tiny_config(*files, total_steps=None, epochs=0.5, target_layout=layout,
                        **{"data.batch_size": None, "data.rows_per_device": 2, "drafter.mask_token_id": None})
    given.mesh.update(fsdp=-1)
    as_given = given.to_dict()
    settled = startup.settle(validate.run_config(given), epath.Path(tmp_path))
    config = settled.config

    assert given.to_dict() == as_given  # the run settles its own copy
    assert settled.plan is None and config.target_layout == settled_layout
    assert (config.data.batch_size, config.data.rows_per_device) == (2 * jax.device_count(), None)
    assert settled.rows == list(range(config.data.batch_size))  # one process reads every row
    tokenizer = AutoTokenizer.from_pretrained(files[0])
    assert config.drafter.mask_token_id == validate.resolve_mask_token_id(given, tokenizer, TARGET_VOCAB)
    step_tokens = epochs.tokens_per_step(config)
    assert config.total_steps == epochs.steps_for_epochs(0.5, settled.loader.corpus_tokens(), step_tokens)
    with pytest.raises(AttributeError):  # read-only from here
        config.total_steps = 1
