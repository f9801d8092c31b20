"""Bad inputs a user can give, each a one-line error naming the file or field, found before the target's
weights load where that is possible: missing or directory data files, an unknown bad_records policy, an
empty, missing, directory or non-UTF-8 prompts file, prompts or documents longer than the target's
max_position_embeddings (prompts: refused; training documents: cut, with a warning), a drafter directory
with target_layer_ids vLLM would reorder, an empty --budgets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from dflash_jax.runtime.errors import CheckpointError, ConfigError, DataError
from dflash_jax.eval.examples import read_examples
from dflash_jax.train.loop import train
from dflash_jax.weights.drafter_files import drafter_config_from_zlab, zlab_config
from tests.command import dflash_jax, user_error
from tests.data_fixtures import completion_records, make_loader, write_jsonl
from tests.drafter_fixtures import make_config
from tests.tokenizer_fixture import make_chat_tokenizer
from tests.train_fixtures import make_target, tiny_config, write_corpus

TINY = "configs/tiny.py"


def test_data_files_are_checked_before_the_target_loads(tmp_path):
    corpus = write_corpus(tmp_path / "train.jsonl", count=10)
    nowhere = tmp_path / "no_target"  # never read: the data files are checked first
    empty = tmp_path / "empty"
    empty.mkdir()
    for bad, reason in ((tmp_path / "missing.jsonl", "no such file"),
                        (empty, "directory holds no saved dataset and no JSONL or Parquet files"),
                        (tmp_path / "*.parquet", "no file matches this pattern")):
        with pytest.raises(DataError) as error:
            train(tiny_config(nowhere, bad), tmp_path / "run")
        assert str(error.value) == f"{bad}: {reason} (config.data.train_files)"
    for bad, reason in ((tmp_path / "missing.jsonl", "no such file"), (tmp_path, "is a directory, not a JSONL file")):
        with pytest.raises(DataError, match=rf"^{bad}: {reason} \(config.data.eval_files\)$"):
            train(tiny_config(nowhere, corpus, **{"data.eval_files": (str(bad),)}), tmp_path / "run")
    assert not (tmp_path / "run").exists()  # a refused start writes nothing

    line = user_error(dflash_jax("train", "--config", TINY, "--workdir", str(tmp_path / "run"),
                                 f"--config.target_dir={nowhere}", f"--config.data.train_files={tmp_path}/a.jsonl"))
    assert line == f"error: {tmp_path}/a.jsonl: no such file (config.data.train_files)"


def test_bad_records_must_be_raise_or_skip(tmp_path):
    config = tiny_config(tmp_path, write_corpus(tmp_path / "train.jsonl", count=10), **{"data.bad_records": "ignore"})
    with pytest.raises(ConfigError, match=r"^config.data.bad_records must be one of \('raise', 'skip'\), "
                                          r"got 'ignore'$"):
        train(config, tmp_path / "run")


def test_prompt_files_that_are_empty_missing_a_directory_or_not_utf8(tmp_path):
    tokenizer = make_chat_tokenizer()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(json.dumps({"prompt": "a", "completion": " b"}).encode() + b"\n"
                       + '{"prompt": "caf\xe9", "completion": " b"}\n'.encode("latin-1"))
    what = "evaluation prompts: --prompts, or config.data.eval_files"
    for files, message in (
            ([empty], f"{empty}: no records to evaluate on ({what})"),
            ([tmp_path / "gone.jsonl"], f"{tmp_path}/gone.jsonl: no such file ({what})"),
            ([tmp_path], f"{tmp_path}: is a directory, not a JSONL file ({what})"),
            ([latin1], f"{latin1}:2: not UTF-8 text (invalid continuation byte at byte 15 of the line); JSONL "
                       f"files must be UTF-8")):
        with pytest.raises(DataError) as error:
            read_examples(files, tokenizer, 10)
        assert str(error.value) == message


def test_evaluate_refuses_bad_prompts_before_loading_the_target_and_an_empty_budgets(tmp_path):
    target = make_target(tmp_path / "target")
    (target / "model.safetensors").write_bytes(b"not read")  # the weights are never reached
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    line = user_error(dflash_jax("evaluate", "--config", TINY, f"--config.target_dir={target}",
                                 "--drafter", str(tmp_path / "drafter"), "--prompts", str(empty)))
    assert line == f"error: {empty}: no records to evaluate on (evaluation prompts: --prompts, or config.data.eval_files)"
    line = user_error(dflash_jax("evaluate", "--config", TINY, "--drafter", "x", "--budgets="))
    assert "--budgets must be one or more positive integers, e.g. --budgets=8,22" in line


def test_prompts_past_the_targets_positions_are_refused(tmp_path):
    path = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "the model " * 20, "completion": " a draft"}])
    tokenizer = make_chat_tokenizer()
    (fits,) = read_examples([path], tokenizer, 1, max_positions=1000, generated=16)
    limit = len(fits.prompt_ids) + 15
    with pytest.raises(DataError) as error:
        read_examples([path], tokenizer, 1, max_positions=limit, generated=16)
    assert str(error.value) == (
        f"{path}:1: the prompt's {len(fits.prompt_ids)} tokens plus 16 continuation tokens exceed the target's "
        f"max_position_embeddings ({limit}); use shorter prompts or fewer continuation tokens (--max_new_tokens)")


def test_training_documents_past_the_targets_positions_are_cut_with_a_warning(tmp_path, caplog):
    path = write_jsonl(tmp_path / "corpus.jsonl", completion_records(30, max_words=200))
    with caplog.at_level(logging.WARNING):
        loader = make_loader([path], seq_len=32, anchor_stride=8, max_positions=40)
        batches = [next(loader) for _ in range(30)]
    assert max(int(batch["positions"].max()) for batch in batches) == 39  # never a position the target lacks
    assert loader.stats()["truncated_documents"] > 0
    warned = [r.getMessage() for r in caplog.records if "max_position_embeddings" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].endswith("is longer than the target's max_position_embeddings (40); trained on its first 40 "
                              "tokens only (counted as truncated_documents)")


def test_a_drafter_directory_with_feature_layers_vllm_would_reorder_is_refused():
    raw = zlab_config(make_config())
    raw["dflash_config"]["target_layer_ids"] = list(reversed(raw["dflash_config"]["target_layer_ids"]))
    with pytest.raises(CheckpointError, match=r"^drafter/config.json: dflash_config: target_layer_ids \[.*\] must "
                                              r"be strictly increasing to be served by vLLM$"):
        drafter_config_from_zlab(raw, Path("drafter/config.json"))
