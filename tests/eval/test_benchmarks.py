"""`evaluate --benchmark` (design §9.6): the prompts against a transcription of z-lab's benchmark.py (and of
DDTree's benchmark for Alpaca) on tiny datasets with each benchmark's real columns, read from every kind of
source (the local Hugging Face cache, JSONL, Parquet, `save_to_disk` directories); bad input refused before any
model loads; and the command end to end on the bundled toy target with a tiny random drafter."""

from __future__ import annotations

import json
import random

import datasets
import numpy as np
import pytest
from flax import nnx
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from configs import toy as toy_recipe
from dflash_jax.commands import evaluate
from dflash_jax.runtime.errors import ConfigError, DataError
from dflash_jax.eval.benchmarks import answered_turns, read_benchmarks, template_kwargs
from dflash_jax.eval.exact_tau import Example, evaluate_drafter
from dflash_jax.eval.examples import stop_token_ids
from dflash_jax.eval.generate import SpeculativeGenerator, generator_shapes
from dflash_jax.models.drafter import Drafter
from dflash_jax.sharding import replicated
from dflash_jax.train import validate
from dflash_jax.train.validate import mesh_from_config
from dflash_jax.weights.drafter_files import export_drafter
from dflash_jax.weights.targets import load_target
from tests.benchmark_fixtures import ROWS
from tests.tokenizer_fixture import make_qwen_tokenizer

SAMPLES = 5  # fewer than some datasets' rows (those are shuffled), as many as or more than others' (kept in order)

# ---- z-lab's benchmark.py (dflash/benchmark.py) and DDTree's (model/utils.py, benchmark.py), restated ---------

_ZLAB_MATH = "{}\nPlease reason step by step, and put your final answer within \\boxed{{}}."
ZLAB_TURNS = {  # z-lab's DATASETS: each row's "format", wrapped in a list unless the dataset is multi-turn
    "gsm8k": lambda row: [_ZLAB_MATH.format(row["question"])],
    "math500": lambda row: [_ZLAB_MATH.format(row["problem"])],
    "humaneval": lambda row: ["Write a solution to the following problem and make sure that it passes the tests:\n"
                              "```python\n" + row["prompt"] + "\n```"],
    "mbpp": lambda row: [row["prompt"]],
    "mt-bench": lambda row: row["prompt"],
}


def zlab_conversations(name: str, rows: list[dict], max_samples: int) -> list[list[str]]:
    """_prepare_dataset's JSONL of {"turns": [...]} per row, read back, then _limit_dataset after the
    transformers backend's `random.seed(0)`: the whole list shuffled in place, the first max_samples kept."""
    lines = [json.dumps({"turns": ZLAB_TURNS[name](row)}) for row in rows]
    dataset = [json.loads(line) for line in lines]
    state = random.getstate()
    random.seed(0)
    if len(dataset) > max_samples:
        random.shuffle(dataset)
        dataset = dataset[:max_samples]
    random.setstate(state)
    return [instance["turns"] for instance in dataset]


def ddtree_alpaca_conversations(rows: list[dict], max_samples: int) -> list[list[str]]:
    """DDTree's alpaca: instruction, plus "\\n\\nInput:\\n" and the input when there is one; its benchmark
    then samples with `Dataset.shuffle(seed=0).select(range(n))`."""
    dataset = datasets.Dataset.from_list(rows).map(lambda x: {"turns": [
        f"{x['instruction']}\n\nInput:\n{x['input']}" if x["input"] else x["instruction"]]})
    if len(dataset) > max_samples:
        dataset = dataset.shuffle(seed=0).select(range(max_samples))
    return [row["turns"] for row in dataset]


def zlab_turn_prompts(tokenizer, turns: list[str], generate) -> list[tuple[list[int], list[int]]]:
    """The transformers backend's loop over a conversation: each user turn appended, the template applied with
    the generation prompt and enable_thinking=False, `tokenizer.encode`d and answered; the answer, decoded
    without special tokens, goes back into the conversation as the assistant's turn."""
    messages, prompts = [], []
    for user_content in turns:
        messages.append({"role": "user", "content": user_content})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=False)
        input_ids = tokenizer.encode(text)
        output_ids = generate(input_ids)
        prompts.append((input_ids, list(output_ids)))
        messages.append({"role": "assistant", "content": tokenizer.decode(output_ids, skip_special_tokens=True)})
    return prompts


def _entries(sources: dict) -> list[str]:
    return ["gsm8k", *(f"{name}={sources[name]}" for name in ("math500", "humaneval", "mbpp", "mt-bench")), "alpaca"]


def _answer(ids) -> np.ndarray:
    """A stand-in for the target's answer, a function of the prompt that holds special tokens (the decoded
    answer must drop them): its last seven ids reversed, then the first id."""
    ids = list(ids)
    return np.asarray(ids[:-8:-1] + ids[:1], np.int32)


def test_prompts_are_z_labs_and_ddtrees(sources, hub_cache):
    suites = read_benchmarks(_entries(sources), samples=SAMPLES)
    assert [suite.name for suite in suites] == ["gsm8k", "math500", "humaneval", "mbpp", "mt-bench", "alpaca"]
    expected = {name: zlab_conversations(name, ROWS[name], SAMPLES) for name in ZLAB_TURNS}
    expected["alpaca"] = ddtree_alpaca_conversations(ROWS["alpaca"], SAMPLES)
    for suite in suites:
        assert suite.conversations == expected[suite.name], suite.name
    assert [len(suite.conversations) for suite in suites] == [5, 5, 4, 5, 3, 5]
    assert suites[0].rows != sorted(suites[0].rows)  # gsm8k's 7 rows were shuffled; humaneval's 4 were not

    # Turn by turn, the same ids as z-lab's loop, with the Qwen3 chat template (thinking off, as z-lab's default).
    tokenizer = make_qwen_tokenizer("qwen3")
    kwargs = template_kwargs(None)
    for suite in suites:
        examples = answered_turns(suite, tokenizer, kwargs, _answer, max_new_tokens=8, max_positions=None)
        reference = [turn for turns in suite.conversations for turn in zlab_turn_prompts(tokenizer, turns, _answer)]
        assert [(e.prompt_ids.tolist(), e.continuation_ids.tolist()) for e in examples] == reference, suite.name
    assert len(answered_turns(suites[4], tokenizer, kwargs, _answer, 8, None)) == 6  # mt-bench: 3 x 2 turns


def test_longbench_rows_are_a_document_then_its_question(sources):
    """A LongBench subset's JSONL as published: one user turn per row, the document then the question, in the
    file's order (4 rows fit the samples); all_classes' nulls do not stop the read."""
    (suite,) = read_benchmarks([f"longbench={sources['longbench']}"], samples=SAMPLES)
    assert suite.rows == [0, 1, 2, 3]
    for turns, row in zip(suite.conversations, ROWS["longbench"]):
        assert turns == ["Read the document and answer the question after it briefly.\n\n" + row["context"]
                         + "\n\nQuestion: " + row["input"]]


def test_bad_benchmarks_are_refused_before_any_model_loads(sources, hub_cache, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown benchmark 'gsm9k'; the benchmarks are gsm8k, math500, "):
        read_benchmarks(["gsm9k"])
    with pytest.raises(DataError, match=r"^google-research-datasets/mbpp: not a file, and not a dataset in the "
                                        r"local Hugging Face cache .*hf download google-research-datasets/mbpp"):
        read_benchmarks(["mbpp"])
    with pytest.raises(DataError, match=rf"{sources['math500']}: no column 'question' .*'problem'"):
        read_benchmarks([f"gsm8k={sources['math500']}"])
    single_turn = tmp_path / "mt_bench.jsonl"
    single_turn.write_text(json.dumps({"prompt": "one turn", "prompt_id": 81}) + "\n")
    with pytest.raises(DataError, match=r"mt-bench: .* row 0, column 'prompt': must be a list of strings"):
        read_benchmarks([f"mt-bench={single_turn}"])
    train_only = tmp_path / "gsm8k_train"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS["gsm8k"])}).save_to_disk(train_only)
    with pytest.raises(DataError, match=r"gsm8k_train: the saved dataset has no split 'test'"):
        read_benchmarks([f"gsm8k={train_only}"])
    with pytest.raises(DataError, match=r"nowhere.jsonl: no such file or directory"):
        read_benchmarks([f"gsm8k={tmp_path / 'nowhere.jsonl'}"])
    # evaluate refuses them before it even reads the drafter (a missing one), let alone the target.
    config = toy_recipe.get_config()
    with pytest.raises(DataError, match=r"no column 'question'"):
        evaluate.run(config, workdir=None, drafter_dir=str(tmp_path / "missing"),
                     benchmarks=[f"gsm8k={sources['math500']}"])
    with pytest.raises(ConfigError, match="neither --prompts nor --continuation=data"):
        evaluate.run(config, workdir=None, drafter_dir=str(tmp_path / "missing"), benchmarks=["gsm8k"],
                     continuation="data")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_evaluate_benchmark_on_the_toy_target(sources, hub_cache, tmp_path, method):
    """Two benchmarks, one multi-turn, with --speed: per benchmark, the drafter's exact τ on the target's greedy
    answers to z-lab's prompts, turn by turn; plain, speculative and (DFlash only, design §18.2) DDTree decoding
    of the same prompts, the drafting decoders lossless with the τ of the table."""
    config = toy_recipe.get_config()
    config.drafter.method = method
    config.mesh = ConfigDict(dict(data=1, fsdp=1, tensor=1, dcn_data=1))
    config.drafter.num_hidden_layers, config.drafter.layer_types = 1, ("full_attention",)
    tokenizer = AutoTokenizer.from_pretrained(config.target_dir)
    mesh = mesh_from_config(config)
    target, target_config = load_target(config.target_dir, param_dtype=np.float32, mesh=mesh,
                                        attention_impl=config.attention_impl)
    drafter_config = validate.resolve_drafter_config(config, target_config, tokenizer)
    drafter = nnx.jit(lambda: Drafter(drafter_config, rngs=nnx.Rngs(1)))()
    export = export_drafter(drafter, drafter_config, tmp_path / "drafter")
    lines = []
    entries = [f"humaneval={sources['humaneval']}", f"mt-bench={sources['mt-bench']}"]
    results = evaluate.run(config, workdir=None, drafter_dir=str(export), benchmarks=entries, num_prompts=2,
                           max_new_tokens=6, budgets=(4,), speed=True, log=lines.append)
    scores = results["benchmarks"]
    assert list(scores) == ["humaneval", "mt-bench"]
    assert [(s["prompts"], s["responses"]) for s in scores.values()] == [(2, 2), (2, 4)]

    # The reference: z-lab's prompts answered by the target's own greedy decoding, scored by exact τ.
    stops = stop_token_ids(config.target_dir, tokenizer)
    plain = SpeculativeGenerator(target, None, **generator_shapes([256], 6, 1))
    drafter = evaluate.placed(drafter, drafter_config, np.float32, replicated(mesh))
    for name, score in scores.items():
        examples = [Example(np.asarray(prompt, np.int32), np.asarray(answer, np.int32))
                    for turns in zlab_conversations(name, ROWS[name], 2) for prompt, answer in zlab_turn_prompts(
                        tokenizer, turns, lambda ids: plain.generate(ids, 6, stops).tokens)]
        reference = evaluate_drafter(target, drafter, examples, budgets=(4,))
        for key in ("responses", "verify_steps", "tau", "tau_per_response", "ddtree_tau", "accepted_histogram"):
            assert score[key] == reference[key], (name, key)
        speed = score["speed"]
        assert speed["responses"] == score["responses"]
        assert speed["outputs_differing_from_plain"] == 0 and speed["tau"] == pytest.approx(score["tau"])
        if method == "dflash":
            assert speed["ddtree"]["outputs_differing_from_plain"] == 0
            assert speed["ddtree"]["tau"] == pytest.approx(score["ddtree_tau"][4])
        else:
            assert "ddtree" not in speed and score["ddtree_tau"] == {}

    table = lines[-1].splitlines()
    tree = {"dflash": (" DDTree τ (4) |", " DDTree (4) tok/s | DDTree speed-up |"), "dspark": ("", "")}[method]
    assert table[0] == (f"| benchmark | prompts | responses | τ | τ per response |{tree[0]} plain tok/s | "
                        f"speculative tok/s | speed-up |{tree[1]}")
    assert [row.split(" | ")[:4] for row in table[2:]] == [
        ["| humaneval", "2", "2", f"{scores['humaneval']['tau']:.2f}"],
        ["| mt-bench", "2", "4", f"{scores['mt-bench']['tau']:.2f}"]]
    json.dumps(results)  # the --json output
