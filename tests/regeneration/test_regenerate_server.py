"""Regeneration through an OpenAI-compatible server (`regenerate --server`), against the local server of
tests/openai_server.py on 127.0.0.1.

Backed by the toy target's own JAX greedy decoding, the output file must equal the JAX path's byte for byte
(prompt records and multi-turn chats, each assistant turn answering the conversation so far). With canned
answers: the per-server concurrency bound holds, 503/429/connection resets are retried to success, a 400 is
one error naming the record, a server rendering other prompt ids than the target's tokenizer is refused,
and jobs stopped by an error or SIGTERM resume to every record exactly once. The command line passes its
flags into the requests and reports a refusal as one line.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from transformers import AutoTokenizer

from dflash_jax.commands import regenerate
from dflash_jax.regeneration.decode import BatchDecoder
from dflash_jax.regeneration.output import PROGRESS_SUFFIX
from dflash_jax.train.validate import mesh_from_config
from dflash_jax.weights.targets import load_target
from tests.command import dflash_jax, user_error
from tests.openai_server import OpenAIServer
from tests.regeneration_fixtures import FAST_RETRY, canned, run_server, write_jsonl
from tests.train_fixtures import tiny_config

REPO = Path(__file__).resolve().parents[2]
TOY_TARGET = REPO / "dflash_jax/assets/toy_target"
MAX_NEW = 12
RECORDS = [
    {"prompt": "def parse(line):\n    return", "source": "a"},
    {"messages": [{"role": "system", "content": "Write Python."}, {"role": "user", "content": "import os"},
                  {"role": "assistant", "content": "old answer"}, {"role": "user", "content": "class Path:"},
                  {"role": "assistant", "content": "old answer"}], "id": 7},
    {"prompt": "for i in range(10):", "completion": "x"},
    {"messages": [{"role": "user", "content": "    def __init__(self):"}]},
]


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def jax_greedy(target_dir: Path, mesh):
    """generate() for OpenAIServer: the target's greedy decoding (decode.py, one prompt at a time), on the mesh
    the JAX path used (the same program: a hit in the tests' compilation cache)."""
    target, _ = load_target(target_dir, param_dtype=jnp.float32, mesh=mesh)
    decoders = {}

    def generate(prompt: list[int], body: dict) -> tuple[list[int], str]:
        key = (body["max_tokens"], tuple(body["stop_token_ids"]))
        if key not in decoders:
            decoders[key] = BatchDecoder(target, batch_size=1, max_new_tokens=key[0], stop_token_ids=key[1], mesh=mesh)
        tokens = decoders[key].decode([prompt], [(0, 0)])[0]
        return tokens, "stop" if tokens[-1] in key[1] else "length"

    return generate


def test_output_equals_the_jax_path_turn_by_turn(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", RECORDS)
    config = tiny_config(TOY_TARGET, prompts)
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
    regenerate.run(config, [str(prompts)], str(tmp_path / "jax.jsonl"), max_new_tokens=MAX_NEW,
                   batch_size=jax.local_device_count(), progress=False)  # a row per device of the decode mesh

    tokenizer = AutoTokenizer.from_pretrained(TOY_TARGET)
    with OpenAIServer(tokenizer, jax_greedy(TOY_TARGET, mesh_from_config(config)), root=str(TOY_TARGET)) as server:
        summary = regenerate.run_server([server.url], [str(prompts)], str(tmp_path / "server.jsonl"),
                                        max_new_tokens=MAX_NEW, temperature=0.0, concurrency=2, progress=False,
                                        chat_template_kwargs={"enable_thinking": False})
    assert summary.records_done == summary.written == len(RECORDS) and summary.generated_tokens > 0
    assert (tmp_path / "server.jsonl").read_bytes() == (tmp_path / "jax.jsonl").read_bytes()

    # One request per response: a chat's second turn carries its first turn's new answer, not the old one.
    chats = [b for b in server.bodies if "messages" in b]
    assert len(chats) == 3 and len(server.bodies) == 5
    assert all(b["temperature"] == 0.0 and b["chat_template_kwargs"] == {"enable_thinking": False} for b in chats)
    second_turn = next(b for b in chats if len(b["messages"]) == 4)
    answer = lines(tmp_path / "jax.jsonl")[1]["messages"][2]["content"]
    assert second_turn["messages"][2] == {"role": "assistant", "content": answer} and answer != "old answer"


def test_concurrency_bound_and_transient_failures_retried(tmp_path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [{"prompt": f"Hello world number {i}", "i": i} for i in range(30)]
    records[5] = {"prompt": "Hello " * 40, "i": 5}  # longer than the served model takes with max_tokens
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    faults, injected = {0: ("status", 503), 1: "reset", 2: ("status", 429), 6: ("status", 502), 7: "reset"}, []

    def fail_some(body, n):  # on the first server only
        if n in faults:
            injected.append(faults[n])
        return faults.get(n)
    servers = [OpenAIServer(tokenizer, canned(tokenizer), max_model_len=40, delay_s=0.02, fault=fault)
               for fault in (fail_some, None)]
    with servers[0], servers[1]:
        summary = run_server(servers, prompts, tmp_path / "out.jsonl", tokenizer_dir, concurrency=3)
    assert all(s.max_in_flight <= 3 for s in servers) and max(s.max_in_flight for s in servers) == 3
    assert len(injected) >= 3  # the first server took at least the first three requests' retries
    assert sum(len(s.bodies) for s in servers) == 29 + len(injected)  # every failure retried; 5 never sent
    assert summary.skipped_long_prompt == 1 and summary.written == 29
    written = lines(tmp_path / "out.jsonl")
    assert [r["i"] for r in written] == [i for i in range(30) if i != 5]
    for record in written:
        ids = tokenizer(record["prompt"], add_special_tokens=False)["input_ids"]
        assert record["completion"] == f" ok {len(ids)}"


def test_refusals_are_one_error_naming_the_record(tmp_path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Hello world"}, {"prompt": "bad request"}])
    bad = tokenizer("bad request", add_special_tokens=False)["input_ids"]
    refuse = lambda body, n: ("status", 400) if body["prompt"] == bad else None  # noqa: E731
    with OpenAIServer(tokenizer, canned(tokenizer), fault=refuse) as server:
        with pytest.raises(ValueError, match=rf"prompts.jsonl:2: {server.url}/v1/completions refused the request: "
                                             r"HTTP 400: injected failure 400 of request \d$"):
            run_server([server], prompts, tmp_path / "out.jsonl", tokenizer_dir, concurrency=1)
    assert [r["prompt"] for r in lines(tmp_path / "out.jsonl")] == ["Hello world"]  # what finished first stays

    chats = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "Hello"}]}])
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        server.prompt_ids = lambda path, body: [599, 599]  # a server with another chat template
        with pytest.raises(ValueError, match=r"chats.jsonl:1: .* rendered turn 0 to other token ids than the "
                                             r"target's tokenizer here \(first difference at token 0\)"):
            run_server([server], chats, tmp_path / "chats_out.jsonl", tokenizer_dir)
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        with pytest.raises(ValueError, match=rf"--server: {server.url} does not serve 'other' \(it serves \['toy'\]\)"):
            run_server([server], prompts, tmp_path / "other.jsonl", tokenizer_dir, model="other")
    with pytest.raises(ValueError, match=r"--server: no OpenAI-compatible server answered: "
                                         r"http://127.0.0.1:9/v1/models: .*after 4 attempts"):
        regenerate.run_server(["http://127.0.0.1:9"], [str(prompts)], str(tmp_path / "x.jsonl"), max_new_tokens=8,
                              retry=FAST_RETRY)


def test_interrupted_jobs_resume_to_every_record_exactly_once(tmp_path, tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [{"messages": [{"role": "user", "content": f"Question {i}"}, {"role": "assistant", "content": "a"},
                             {"role": "user", "content": "And then?"}], "i": i} if i % 3 == 0
               else {"prompt": f"Hello world number {i}", "i": i} for i in range(24)]
    prompts = write_jsonl(tmp_path / "prompts.jsonl", records)
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        run_server([server], prompts, tmp_path / "whole.jsonl", tokenizer_dir, concurrency=4)
    whole = (tmp_path / "whole.jsonl").read_bytes()
    out = tmp_path / "out.jsonl"

    def refuse_record_13(body, n):
        return ("status", 400) if body.get("prompt") == tokenizer("Hello world number 13",
                                                                  add_special_tokens=False)["input_ids"] else None
    with OpenAIServer(tokenizer, canned(tokenizer), fault=refuse_record_13, delay_s=0.01) as server:
        with pytest.raises(ValueError, match="prompts.jsonl:14: .* HTTP 400"):
            run_server([server], prompts, out, tokenizer_dir, concurrency=4)
    first = json.loads(out.with_name(out.name + PROGRESS_SUFFIX).read_text())["records_done"]
    assert 0 < first <= 13 and len(lines(out)) == first

    def stop_at_request_6(body, n):
        if n == 6:
            os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption would
    with OpenAIServer(tokenizer, canned(tokenizer), fault=stop_at_request_6, delay_s=0.01) as server:
        summary = run_server([server], prompts, out, tokenizer_dir, concurrency=2)
    assert summary.stopped_by == "SIGTERM" and first < summary.records_done < len(records)

    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        run_server([server], prompts, out, tokenizer_dir, concurrency=4)
    assert out.read_bytes() == whole
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        with pytest.raises(ValueError, match=r"other settings .*'max_new_tokens': \(8, 9\)"):
            regenerate.run_server([server.url], [str(prompts)], str(out), max_new_tokens=9,
                                  tokenizer=str(tokenizer_dir))


@pytest.mark.slow  # the command's start-up (importing JAX, transformers, torch) is most of it: `make test-slow`
def test_the_command_line(tmp_path, tokenizer_dir):
    """`dflash-jax regenerate --server`: the flags reach the requests (sampling not given is left out, for the
    server's defaults), and a refused request is one error line naming the record, after the records before it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [{"prompt": "Hello world"}, {"messages": [{"role": "user", "content": "Hello"}]}, {"prompt": "bad"}]
    prompts, out = write_jsonl(tmp_path / "prompts.jsonl", records), tmp_path / "out.jsonl"
    bad = tokenizer("bad", add_special_tokens=False)["input_ids"]
    with OpenAIServer(tokenizer, canned(tokenizer),
                      fault=lambda body, n: ("status", 400) if body.get("prompt") == bad else None) as server:
        result = dflash_jax("regenerate", f"--server={server.url}", f"--prompts={prompts}", f"--out={out}",
                            f"--tokenizer={tokenizer_dir}", "--temperature=0", "--max_new_tokens=5", "--concurrency=1",
                            '--chat_template_kwargs={"enable_thinking": false}', "--quiet")
    assert user_error(result) == (f"error: {prompts}:3: {server.url}/v1/completions refused the request: HTTP 400: "
                                  f"injected failure 400 of request 2")
    assert [(b["temperature"], b["max_tokens"], "top_p" in b) for b in server.bodies] == [(0.0, 5, False)] * 3
    assert server.bodies[1]["chat_template_kwargs"] == {"enable_thinking": False}
    assert [set(r) for r in lines(out)] == [{"prompt", "completion"}, {"messages"}]
