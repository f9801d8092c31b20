"""Data regeneration (`python -m dflash_jax.regenerate`) on tiny random targets of both families.

The written responses must be the target's greedy continuations computed without any cache (the argmax of a
full forward after each token), for prompts of different lengths decoded together on a mesh; a job stopped
by SIGTERM or killed by SIGKILL and rerun must hold every record exactly once, as an uninterrupted run does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from transformers import AutoTokenizer

from dflash_jax.commands import regenerate
from dflash_jax.eval.examples import stop_token_ids
from dflash_jax.ops.lm_head import fp32_logits
from dflash_jax.weights.targets import load_target
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.output import PROGRESS_SUFFIX, ResumableJsonl
from tests.process_fixtures import cpu_env, outputs_of, start_two_processes
from tests.train_fixtures import (make_qwen3_5_moe_target, make_qwen3_5_target, make_qwen3_moe_target, make_target,
                                  tiny_config)

REPO = Path(__file__).resolve().parents[2]
MAX_NEW = 12
RECORDS = [
    {"prompt": "Hello world", "source": "a"},
    {"prompt": "Explain why the model drafts a block of tokens, then the target verifies it", "completion": "x"},
    {"messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a row?"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "And a block?"},
                  {"role": "assistant", "content": "old answer"}], "id": 7},
    {"messages": [{"role": "user", "content": "Please explain the anchor"}]},
    {"prompt": "def f(x):\n    return"},
]


# The hybrid and mixture-of-experts targets (a Qwen3-MoE with a dense layer among its sparse ones, a Qwen3.5-MoE)
# in make test-slow (the hybrid target's cached decoding is in make test through tests/eval/test_hybrid_decoding.py).
@pytest.fixture(scope="module", params=["qwen3", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                        pytest.param("qwen3_moe", marks=pytest.mark.slow),
                                        pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def target_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        return make_target(directory, num_layers=3)
    if request.param == "qwen3_moe":
        return make_qwen3_moe_target(directory, num_hidden_layers=3, mlp_only_layers=[1])
    if request.param == "qwen3_5_moe":
        return make_qwen3_5_moe_target(directory)
    return make_qwen3_5_target(directory)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@nnx.jit  # one function for every call below: each model compiles once
def full_forward_logits(model, ids):
    positions = jnp.arange(ids.shape[1])[None]
    return fp32_logits(model(ids, positions, jnp.ones_like(ids)).hidden, model.lm_head_kernel())


def uncached_greedy(model, prompt: list[int], stops: tuple[int, ...], width: int = 128) -> list[int]:
    """Token by token: the argmax of a full forward over the text so far (right padding changes nothing
    before it), until a stop token or MAX_NEW tokens."""
    text = list(prompt)
    for _ in range(MAX_NEW):
        ids = np.zeros((1, width), np.int32)
        ids[0, :len(text)] = text
        text.append(int(np.argmax(full_forward_logits(model, ids)[0, len(text) - 1])))
        if text[-1] in stops:
            break
    return text[len(prompt):]


def test_greedy_responses_equal_uncached_greedy_decoding(target_dir, tmp_path):
    config = tiny_config(target_dir, tmp_path / "unused.jsonl")
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2  # rows over data x fsdp
    prompts = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    summary = regenerate.run(config, [str(prompts)], str(tmp_path / "out.jsonl"), max_new_tokens=MAX_NEW,
                             batch_size=4, progress=False)
    assert summary.records_done == summary.written == len(RECORDS) and summary.generated_tokens > 0
    written = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]

    model, _ = load_target(target_dir, param_dtype=jnp.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    stops = stop_token_ids(target_dir, tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731

    def expected(prompt_ids):
        ids = uncached_greedy(model, prompt_ids, stops)
        return tokenizer.decode(ids[:-1] if ids[-1] in stops else ids)

    assert [set(r) for r in written] == [{"prompt", "completion", "source"}, {"prompt", "completion"},
                                         {"messages", "id"}, {"messages"}, {"prompt", "completion"}]
    for record, output in zip(RECORDS, written):
        if "prompt" in record:
            assert output["prompt"] == record["prompt"]
            assert output["completion"] == expected(encode(record["prompt"]))
            continue
        messages = output["messages"]  # every assistant turn answers the conversation before it
        assert [m["role"] for m in messages] == [m["role"] for m in record["messages"]] + (
            [] if record["messages"][-1]["role"] == "assistant" else ["assistant"])
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                rendered = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                assert message["content"] == expected(encode(rendered)) != "old answer"
            else:
                assert message == record["messages"][i]


@pytest.mark.slow  # about a minute of CPU: `make test-slow`
def test_sampling_depends_on_the_seed_and_the_record_only(target_dir, tmp_path):
    """A sampled response is the same whatever else is in its batch (so a resumed job samples as an
    uninterrupted one would), and changes with the seed."""
    config = tiny_config(target_dir, tmp_path / "unused.jsonl")
    config.mesh.data, config.mesh.fsdp = 8, 1
    records = [{"prompt": f"Hello world {i}"} for i in range(8)]
    other_rows = records[:4] + [{"prompt": f"Please explain the anchor {i}"} for i in range(4)]

    def sample(name, chunk, seed):
        prompts = write_jsonl(tmp_path / f"{name}.prompts.jsonl", chunk)
        regenerate.run(config, [str(prompts)], str(tmp_path / f"{name}.jsonl"), max_new_tokens=MAX_NEW,
                       batch_size=8, temperature=1.5, top_p=0.9, seed=seed, progress=False)
        return [json.loads(line)["completion"] for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]

    first = sample("first", records, seed=1)
    assert len(set(first)) > 1
    assert sample("other_rows", other_rows, seed=1)[:4] == first[:4]
    assert sample("other_seed", records, seed=2) != first


def test_resume_cuts_what_a_kill_left_and_appends_each_record_once(tmp_path):
    out = tmp_path / "out.jsonl"
    writer = ResumableJsonl(out, {"seed": 0})
    writer.append([{"n": 0}, {"n": 1}], records_consumed=3)  # one input record was dropped
    with open(out, "a") as handle:  # a batch written but never recorded, ending in a torn line
        handle.write('{"n": 2}\n{"n": 3')
    resumed = ResumableJsonl(out, {"seed": 0})
    assert (resumed.records_done, resumed.lines) == (3, 2)
    assert out.read_text() == '{"n": 0}\n{"n": 1}\n'
    resumed.append([{"n": 2}], records_consumed=1)
    assert out.read_text() == '{"n": 0}\n{"n": 1}\n{"n": 2}\n'
    with pytest.raises(ValueError, match=r"other settings .*'seed': \(0, 1\)"):
        ResumableJsonl(out, {"seed": 1})
    (tmp_path / "foreign.jsonl").write_text('{"prompt": "x", "completion": "y"}\n')
    with pytest.raises(ValueError, match="was not written by regenerate"):
        ResumableJsonl(tmp_path / "foreign.jsonl", {})


def _start(args: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as a laptop
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"  # a tiny model: compile time dominates
    return subprocess.Popen([sys.executable, "-m", "dflash_jax.regenerate", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_for_progress(out: Path, more_than: int, process: subprocess.Popen, timeout: float = 300) -> int:
    progress = out.with_name(out.name + PROGRESS_SUFFIX)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if progress.is_file():
            done = json.loads(progress.read_text())["records_done"]
            if done > more_than:
                return done
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.05)
    raise AssertionError(f"no progress past {more_than} records in {timeout} s")


@pytest.mark.slow  # two jobs stopped and killed mid-run, ~20 s; the server path's resume test stays in make test
def test_stopped_and_killed_jobs_resume_to_every_record_exactly_once(tmp_path):
    target_dir = make_target(tmp_path / "target", num_layers=2)
    records = [{"prompt": f"Hello world number {i} please", "i": i} for i in range(40)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    config = tiny_config(target_dir, prompts)
    config_file = tmp_path / "config.py"
    config_file.write_text("from tests.train_fixtures import tiny_config\n\n\ndef get_config():\n"
                           f"    return tiny_config({str(target_dir)!r}, {str(prompts)!r})\n")
    out = tmp_path / "out.jsonl"
    args = [f"--config={config_file}", f"--prompts={prompts}", f"--out={out}", "--batch_size=2",
            f"--max_new_tokens={MAX_NEW}", "--quiet"]

    stopped = _start(args)
    _wait_for_progress(out, 0, stopped)
    stopped.send_signal(signal.SIGTERM)
    log = stopped.communicate(timeout=300)[0]
    assert stopped.returncode == regenerate.STOPPED_EXIT_CODE, log
    assert "stopped by SIGTERM" in log
    done = json.loads(out.with_name(out.name + PROGRESS_SUFFIX).read_text())["records_done"]
    assert 0 < done < len(records) and len(out.read_text().splitlines()) == done

    killed = _start(args)
    _wait_for_progress(out, done, killed)
    killed.kill()  # SIGKILL: no handler runs
    killed.communicate(timeout=60)

    config.mesh.data, config.mesh.fsdp = 8, 1  # the rest in this process (8 devices): another batch size
    regenerate.run(config, [str(prompts)], str(out), max_new_tokens=MAX_NEW, batch_size=8, progress=False)
    lines = out.read_text().split("\n")
    assert lines[-1] == ""  # ends with a newline: no torn last line
    assert [json.loads(line)["i"] for line in lines[:-1]] == list(range(len(records)))


def test_setup_errors_are_one_line(tmp_path):
    target_dir = make_target(tmp_path / "target", num_layers=2)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "x"}, {"completion": "no prompt"}])
    config = tiny_config(target_dir, prompts)
    config.mesh.data = 2
    with pytest.raises(ValueError, match="batch_size .3. must be a positive multiple of the decode mesh's data size"):
        regenerate.run(config, [str(prompts)], str(tmp_path / "out.jsonl"), max_new_tokens=4, batch_size=3)
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        regenerate.run(config, [str(prompts)], str(tmp_path / "out.jsonl"), max_new_tokens=4, batch_size=8,
                       temperature=-1)
    with pytest.raises(ValueError, match=r"prompts.jsonl:2: record is missing 'prompt'"):
        regenerate.run(config, [str(prompts)], str(tmp_path / "out.jsonl"), max_new_tokens=4, batch_size=8,
                       progress=False)


@pytest.mark.slow  # about 14 s on 2 shared cores (make test-slow); test_greedy_responses_* refills rows too
def test_refilled_rows_and_buckets_decode_as_uncached_greedy(tmp_path):
    """Seven prompts of two buckets (up to 128 tokens and 129-256) through a batch of two rows refilled one
    at a time, responses of different lengths: rows are refilled mid-decode, the cache's columns shift, and
    every response is still the uncached greedy continuation of its prompt."""
    target_dir = make_target(tmp_path / "target", num_layers=2)
    model, _ = load_target(target_dir, param_dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 600, size=int(length)).tolist() for length in (5, 140, 60, 200, 3, 129, 90)]
    greedy = [uncached_greedy(model, prompt, (), width=256) for prompt in prompts]
    stops = (greedy[0][3], greedy[3][1], greedy[4][6])  # tokens that end some responses early

    def cut(tokens):  # the greedy continuation with these stop tokens: up to and including the first
        return next((tokens[:i + 1] for i, token in enumerate(tokens) if token in stops), tokens)

    decoder = BatchDecoder(model, batch_size=2, max_new_tokens=MAX_NEW, stop_token_ids=stops)
    assert decoder.refill_rows == 1
    shifts, shift = [], decoder._shift  # a spy: each column shift still runs
    decoder._shift = lambda *args: shifts.append(int(args[2])) or shift(*args)
    responses = decoder.decode(prompts, [()] * len(prompts))
    assert shifts and min(shifts) > 0
    assert len({len(r) for r in responses}) > 2
    assert responses == [cut(tokens) for tokens in greedy]


@pytest.mark.slow  # five processes start, load and compile: about 85 s on 2 shared cores (make test-slow)
def test_two_processes_write_every_record_once_as_one_process(tmp_path):
    """`regenerate` as two processes of four CPU devices (jax.distributed): each decodes its share into a part
    file, process 0 merges them; the output equals the one-process run's byte for byte, parts removed, and
    a rerun of the finished job changes nothing."""
    target_dir = make_target(tmp_path / "target", num_layers=2)
    records = [{"prompt": f"Hello world number {i} " + "please " * (i % 5), "i": i} for i in range(11)] + RECORDS
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    config_file = tmp_path / "config.py"
    config_file.write_text("from tests.train_fixtures import tiny_config\n\n\ndef get_config():\n"
                           f"    return tiny_config({str(target_dir)!r}, {str(prompts)!r})\n")
    args = [f"--config={config_file}", f"--prompts={prompts}", "--batch_size=4", f"--max_new_tokens={MAX_NEW}",
            "--quiet"]
    module = [sys.executable, "-m", "dflash_jax.regenerate"]
    outputs = outputs_of(start_two_processes([*module, *args, f"--out={tmp_path / 'two.jsonl'}"]))
    assert "process 0 of 2" in outputs[0]
    one = subprocess.run([*module, *args, f"--out={tmp_path / 'one.jsonl'}"], cwd=REPO, env=cpu_env(4),
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]

    expected = (tmp_path / "one.jsonl").read_text()
    assert [json.loads(line).get("i") for line in expected.splitlines()][:11] == list(range(11))
    assert (tmp_path / "two.jsonl").read_text() == expected
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("two.")) == [
        "two.jsonl", "two.jsonl" + PROGRESS_SUFFIX]
    assert json.loads((tmp_path / ("two.jsonl" + PROGRESS_SUFFIX)).read_text())["records_done"] == len(records)
    outputs_of(start_two_processes([*module, *args, f"--out={tmp_path / 'two.jsonl'}"]))  # a rerun: all done
    assert (tmp_path / "two.jsonl").read_text() == expected
    assert not list(tmp_path.glob("two.jsonl.part-*"))
