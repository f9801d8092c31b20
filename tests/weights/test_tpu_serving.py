"""The model card's "Serve on TPUs" section (weights/tpu_serving.py): what vLLM TPU 0.32 makes of each kind of
export, as `make test-vllm-tpu` finds it (tests/serving_tpu/), and TPU commands that parse."""

from __future__ import annotations

import argparse
import dataclasses
import shlex

import pytest

from dflash_jax.weights.drafter_files import serve_command
from dflash_jax.weights.model_card import TrainingFacts, model_card
from tests.drafter_fixtures import BLOCK, FULL, SLIDING, make_config

TARGET, DRAFTER = "Qwen/Qwen3-8B", "my-org/qwen3-8b-dflash"


def tpu_section(config) -> tuple[str, list[list[str]]]:
    """(the section's text, its commands split into words: one a line)."""
    card = model_card(config, TrainingFacts(target=TARGET, data_files=[], steps=1), DRAFTER)
    section = card.split("## Serve on TPUs\n")[1]
    blocks = [block.split("```")[0] for block in section.split("```bash\n")[1:]]
    return section, [shlex.split(line) for block in blocks for line in block.strip().splitlines()]


def sglang_jax_flags(words: list[str]) -> argparse.Namespace:
    assert words[:3] == ["python", "-m", "sgl_jax.launch_server"]
    parser = argparse.ArgumentParser()
    for flag in ("--model-path", "--speculative-algorithm", "--speculative-draft-model-path"):
        parser.add_argument(flag, required=True)
    for flag in ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        parser.add_argument(flag, type=int, required=True)
    flags = parser.parse_args(words[3:])
    assert (flags.model_path, flags.speculative_algorithm, flags.speculative_draft_model_path) == (
        TARGET, "DFLASH", DRAFTER)
    # SGLang-JAX's DFLASH drafts one linear chain of a block per step.
    assert (flags.speculative_num_steps, flags.speculative_eagle_topk, flags.speculative_num_draft_tokens) == (
        1, 1, BLOCK)
    return flags


def test_a_full_attention_drafter_is_served_by_vllm_tpu_with_the_gpu_line_and_by_sglang_jax():
    config = make_config((FULL, FULL))
    text, (vllm, sglang_jax) = tpu_section(config)
    assert "vLLM TPU serves it with the same `vllm serve` line" in text
    assert "θ 1e6 with Llama-3 frequency scaling" in text  # its RoPE, not the trained one
    assert vllm == shlex.split(serve_command(TARGET, DRAFTER, config))
    sglang_jax_flags(sglang_jax)


@pytest.mark.parametrize("layers, what", [((SLIDING, SLIDING), "runs its sliding layers as full attention"),
                                          ((SLIDING, FULL), "refuses this drafter, which mixes sliding and full")])
def test_a_drafter_with_sliding_layers_is_offered_sglang_jax_with_its_window(layers, what):
    text, commands = tpu_section(make_config(layers, sliding_window=5))
    for fact in (what, "pull request #3528", "11% acceptance", "48-50%", "window of 5 tokens", "a GPU engine"):
        assert fact in " ".join(text.split()), fact
    (words,) = commands  # no vLLM TPU line
    assert words[0] == "SGL_JAX_DFLASH_DRAFT_PREFIX_WINDOW=5"
    sglang_jax_flags(words[1:])


@pytest.mark.parametrize("method, fields, title", [
    ("dspark", dict(markov_rank=4), "DSpark"),
    ("dflash2", dict(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4), "DFlash2")])
def test_dspark_and_dflash2_exports_have_no_tpu_server_yet(method, fields, title):
    config = dataclasses.replace(make_config(), method=method, **fields)
    text, commands = tpu_section(config)
    assert f"No TPU server runs {title} drafters yet" in text
    assert commands == []
