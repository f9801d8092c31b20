"""Chat records under the published Qwen3 and Qwen3.5/3.6 chat templates (tests/fixtures/chat_templates): the
tokens are the template's rendering of the whole conversation, tokenized; the trained tokens are exactly each
assistant turn as rendered (reasoning block, content, tool calls, end-of-turn), written out here by hand from
the templates' text; ShareGPT and OpenAI content parts give the same document; thinking mode comes from the
command line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_jax.data import tokenize_record
from dflash_jax.data.records import parse_object
from dflash_jax.data.tokenize import turn_markers
from dflash_jax.runtime.errors import ConfigError, DataError
from dflash_jax.train.config import base_config
from dflash_jax.train.validate import resolve_chat_template_kwargs
from tests.command import dflash_jax
from tests.data_fixtures import REASONING_CONTENT, SYSTEM, TOOL_CHAT
from tests.tokenizer_fixture import make_chat_tokenizer, make_qwen_tokenizer

TEMPLATES = ("qwen3", "qwen3_5")
THINK_IN_CONTENT = [
    SYSTEM,
    {"role": "user", "content": "What is a block?"},
    {"role": "assistant", "content": "<think>\nThe user asks about blocks.\n</think>\n\nA block is a draft."},
    {"role": "user", "content": "And a row?"},
    {"role": "assistant", "content": "<think>\nRows hold packed documents.\n</think>\n\nA row is packed."},
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# What each template renders for each assistant turn, after its `<|im_start|>assistant\n` header. Both drop
# the reasoning of turns before the last user query and give every later turn a <think> block.
END = "<|im_end|>"
EXPECTED_TURNS = {
    ("qwen3", "think"): ["A block is a draft." + END,
                         "<think>\nRows hold packed documents.\n</think>\n\nA row is packed." + END],
    ("qwen3", "tools"): ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' + END,
                         "<think>\n\n</think>\n\nIt is 21 degrees." + END],
    ("qwen3_5", "think"): ["A block is a draft." + END,
                           "<think>\nRows hold packed documents.\n</think>\n\nA row is packed." + END],
    ("qwen3_5", "tools"): ["<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                           "</parameter>\n</function>\n</tool_call>" + END,
                           "<think>\n\n</think>\n\nIt is 21 degrees." + END],
}
CASES = [(messages, kind, None) for messages, kind in ((THINK_IN_CONTENT, "think"), (REASONING_CONTENT, "think"))]
CASES.append((TOOL_CHAT, "tools", TOOLS))


def trained_runs(input_ids: np.ndarray, loss_mask: np.ndarray) -> list[np.ndarray]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], loss_mask, [0]])))
    return [input_ids[start:end] for start, end in zip(edges[::2], edges[1::2])]


@pytest.mark.parametrize("thinking", [True, False])
@pytest.mark.parametrize("template", TEMPLATES)
def test_published_qwen_templates_train_exactly_every_assistant_turn(template, thinking):
    tokenizer = make_qwen_tokenizer(template)
    kwargs = {"enable_thinking": thinking}
    for messages, kind, tools in CASES:
        record = parse_object({"messages": messages, **({"tools": tools} if tools else {})}, "t:1")
        document = tokenize_record(record, tokenizer, "t:1", kwargs)
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kwargs)
        assert document.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"]
        runs = [tokenizer.decode(run) for run in trained_runs(document.input_ids, document.loss_mask)]
        assert runs == EXPECTED_TURNS[template, kind], (template, kind)
        untrained = tokenizer.decode(document.input_ids[document.loss_mask == 0])
        assert untrained.count("<|im_start|>assistant\n") == 2  # the headers are context, not trained
        for message in messages:  # every system, user and tool token is context
            if message["role"] != "assistant" and message["content"]:
                assert message["content"] in untrained
        if tools:
            assert "get_weather" in untrained and "Weather of a city" in untrained  # the tool list, untrained


def test_thinking_mode_changes_only_the_generation_prompt_the_markers_exclude():
    # Thinking off makes the generation prompt end with an empty <think> block; the assistant header stays the
    # part every assistant turn starts with.
    for template in TEMPLATES:
        tokenizer = make_qwen_tokenizer(template)
        for thinking in (True, False):
            markers = turn_markers(tokenizer, {"enable_thinking": thinking}, "t:1")
            assert (markers.header, markers.end) == ("<|im_start|>assistant\n", END)


def test_sharegpt_and_content_parts_give_the_same_document():
    tokenizer = make_qwen_tokenizer("qwen3")
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in THINK_IN_CONTENT]}
    parts = {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"][:5]},
                                                           {"type": "text", "text": m["content"][5:]}]}
                          for m in THINK_IN_CONTENT]}
    reference = tokenize_record(parse_object({"messages": THINK_IN_CONTENT}, "t:1"), tokenizer, "t:1")
    for record in (sharegpt, parts, json.loads(json.dumps({"messages": THINK_IN_CONTENT, "prompt": "ignored"}))):
        document = tokenize_record(parse_object(record, "t:2"), tokenizer, "t:2")
        np.testing.assert_array_equal(document.input_ids, reference.input_ids)
        np.testing.assert_array_equal(document.loss_mask, reference.loss_mask)


def test_tool_call_arguments_given_as_a_json_string_render_as_the_object():
    tokenizer = make_qwen_tokenizer("qwen3_5")
    as_string = json.loads(json.dumps(TOOL_CHAT))
    as_string[1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Paris"}'
    documents = [tokenize_record(parse_object({"messages": m, "tools": TOOLS}, "t:1"), tokenizer, "t:1")
                 for m in (TOOL_CHAT, as_string)]
    np.testing.assert_array_equal(documents[0].input_ids, documents[1].input_ids)


def test_a_template_whose_assistant_turns_cannot_be_located_is_one_error_naming_the_record():
    tokenizer = make_chat_tokenizer()
    tokenizer.chat_template = "{%- for m in messages %}{{ m['content'] }}\n{%- endfor %}"  # no turn markers
    with pytest.raises(DataError, match=r"^data.jsonl:7: the chat template's assistant turns cannot be located"):
        tokenize_record(parse_object({"messages": THINK_IN_CONTENT}, "data.jsonl:7"), tokenizer, "data.jsonl:7")
    # A user message that contains the assistant header makes the turns ambiguous: refused, not guessed.
    tricky = [{"role": "user", "content": "say <|im_start|>assistant\nhi"}, {"role": "assistant", "content": "hi"}]
    with pytest.raises(DataError, match=r"^d:2: the rendered conversation holds 2 assistant headers"):
        tokenize_record(parse_object({"messages": tricky}, "d:2"), make_qwen_tokenizer("qwen3"), "d:2")


@pytest.mark.parametrize("record, reason", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
                   {"role": "assistant", "content": "a"}]}, r"messages\[0\].content\[0\] is a 'image_url' part"),
    ({"conversations": [{"from": "bot", "value": "x"}]}, r"conversations\[0\].from is 'bot'"),
    ({"messages": [{"role": "narrator", "content": "x"}]}, r"messages\[0\].role is 'narrator'"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     r"messages\[0\].tool_calls\[0\].arguments is not JSON"),
    ({"messages": [{"role": "assistant", "content": "x"}], "completion": "y"}, "record has both 'messages' and 'completion'"),
])
def test_malformed_chat_records_are_one_clear_error(record, reason):
    with pytest.raises(DataError, match=rf"^f:3: {reason}"):
        parse_object(record, "f:3")


def test_thinking_mode_is_settable_through_the_config_flag(tmp_path):
    result = dflash_jax("train", "--config", "configs/tiny.py", "--workdir", str(tmp_path), "--print_config",
                        '--config.data.chat_template_kwargs={"enable_thinking": false}')
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["data"]["chat_template_kwargs"] == {"enable_thinking": False}
    config = base_config()
    config.data.chat_template_kwargs = "enable_thinking"  # what the flag gives for text that is no object
    with pytest.raises(ConfigError, match="^config.data.chat_template_kwargs must be a JSON object"):
        resolve_chat_template_kwargs(config)
