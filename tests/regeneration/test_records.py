"""Prompt records for `regenerate` are read as training reads them (data/records.py): OpenAI and ShareGPT chats,
a chat's tools included. The prompt a turn is answered from is the one training renders for it, on the JAX path
and through a server (which gets the tools in its request)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax.data.records import parse_record
from dflash_jax.data.tokenize import tokenize_prompt
from dflash_jax.regeneration.records import Regeneration, parse_prompt_record
from dflash_jax.runtime.errors import DataError
from tests.openai_server import OpenAIServer
from tests.regeneration_fixtures import canned, run_server, write_jsonl
from tests.tokenizer_fixture import make_qwen_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
SHAREGPT = {"conversations": [{"from": "system", "value": "You check the weather."},
                              {"from": "human", "value": "Weather in Paris?"}], "tools": TOOLS, "id": 7}


@pytest.mark.parametrize("template", ["qwen3", "qwen3_5"])
def test_a_sharegpt_chat_with_tools_is_prompted_as_training_renders_it(template):
    tokenizer = make_qwen_tokenizer(template)
    line = json.dumps(SHAREGPT)
    record = parse_prompt_record(line, "p:1")
    assert record["messages"][1] == {"role": "user", "content": "Weather in Paris?"}
    assert record["tools"] == TOOLS and record["id"] == 7 and "conversations" not in record
    regeneration = Regeneration(record, tokenizer, "p:1")
    prompt = regeneration.prompt()
    np.testing.assert_array_equal(prompt, tokenize_prompt(parse_record(line, "p:1", prompt_only=True), tokenizer, "p:1"))
    assert "get_weather" in tokenizer.decode(prompt)
    regeneration.accept(tokenizer("It is sunny.", add_special_tokens=False)["input_ids"], ())
    out = regeneration.output()
    assert out["messages"][-1] == {"role": "assistant", "content": "It is sunny."}
    assert out["tools"] == TOOLS and out["id"] == 7 and "conversations" not in out


def test_prompt_records_are_refused_as_training_refuses_them():
    with pytest.raises(DataError, match="only assistant turns"):
        parse_prompt_record(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}), "p:1")
    with pytest.raises(DataError, match="'tools' must be a list of tool objects"):
        parse_prompt_record(json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": 3}), "p:1")
    with pytest.raises(DataError, match="conversations\\[0\\].from is 'robot'"):
        parse_prompt_record(json.dumps({"conversations": [{"from": "robot", "value": "x"}]}), "p:1")


def test_a_server_gets_the_tools_and_renders_the_prompt_the_target_tokenizer_does(tmp_path):
    """The job compares the server's prompt ids with its own rendering (a server that renders other ids is
    refused): both render the tools, and the request asks for raw text (tool_choice "none")."""
    tokenizer = make_qwen_tokenizer("qwen3")
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [SHAREGPT])
    with OpenAIServer(tokenizer, canned(tokenizer)) as server:
        summary = run_server([server], prompts, tmp_path / "out.jsonl", tmp_path / "tokenizer")
    assert summary.written == 1
    assert server.bodies[0]["tools"] == TOOLS and server.bodies[0]["tool_choice"] == "none"
    written = json.loads((tmp_path / "out.jsonl").read_text())
    assert written["tools"] == TOOLS and written["messages"][-1]["role"] == "assistant"
