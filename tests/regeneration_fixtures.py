"""Regeneration through an OpenAI-compatible server: records, a canned generator and `regenerate --server`."""

from __future__ import annotations

import json
from pathlib import Path


from dflash_jax.commands import regenerate
from dflash_jax.regeneration.server_client import Retry


FAST_RETRY = Retry(attempts=4, first_delay_s=0.01, max_delay_s=0.05)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def canned(tokenizer):
    """generate() for OpenAIServer: a short answer that names the prompt's length, then the stop token."""
    def generate(prompt: list[int], body: dict) -> tuple[list[int], str]:
        return tokenizer(f" ok {len(prompt)}", add_special_tokens=False)["input_ids"] + body["stop_token_ids"][:1], \
            "stop"
    return generate


def run_server(servers, prompts: Path, out: Path, tokenizer_dir: Path, **kwargs):
    return regenerate.run_server([s.url for s in servers], [str(prompts)], str(out), max_new_tokens=8,
                                 tokenizer=str(tokenizer_dir), progress=False, retry=FAST_RETRY, **kwargs)
