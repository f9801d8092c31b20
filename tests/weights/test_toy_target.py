"""The bundled toy target (dflash_jax/assets/toy_target) and its drafter data (dflash_jax/assets/toy_data).

Both are built by tools/make_toy_target.py; these checks only read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.data.records import CompletionRecord, parse_record
from dflash_jax.weights.safetensors_dir import CheckpointReader
from dflash_jax.weights.targets import load_target
from tools.toy_target.corpus import split_of
from tools.toy_target.drafter_data import BATCH_SIZE

REPO = Path(__file__).resolve().parents[2]
ASSETS = REPO / "dflash_jax" / "assets"
TARGET, DATA = ASSETS / "toy_target", ASSETS / "toy_data"

CODE = (
    "import os\n\n\n"
    "def read_lines(path):\n"
    '    """Return the lines of the file at path."""\n'
    "    with open(path) as handle:\n"
    "        return handle.read().splitlines()\n\n\n"
    "class Counter:\n"
    "    def __init__(self, start=0):\n"
    "        self.value = start\n\n"
    "    def increment(self):\n"
    "        self.value += 1\n"
    "        return self.value\n"
)


def _tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TARGET)


def _jax_logits(model, ids: list[int]) -> np.ndarray:
    input_ids = jnp.asarray([ids], jnp.int32)
    positions = jnp.arange(len(ids))[None]
    hidden = model(input_ids, positions, jnp.zeros_like(positions)).hidden
    return np.asarray(model.logits(hidden), np.float32)[0]


def test_loads_with_load_target_and_transformers_same_logits():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    ids = _tokenizer()(CODE, add_special_tokens=False)["input_ids"]
    model, config = load_target(TARGET, param_dtype=jnp.float32)
    got = _jax_logits(model, ids)
    hf_model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert hf_model.config.model_type == "qwen3" and config.tie_word_embeddings


def test_is_a_trained_model_of_code():
    # A random model scores about log(vocab) ~ 8.3 nats/token; the trained one is far below that.
    ids = _tokenizer()(CODE, add_special_tokens=False)["input_ids"]
    model, _ = load_target(TARGET, param_dtype=jnp.float32)
    log_probs = np.asarray(jax.nn.log_softmax(_jax_logits(model, ids)[:-1], axis=-1))
    loss = -np.mean(log_probs[np.arange(len(ids) - 1), ids[1:]])
    assert loss < 3.0, loss


def test_config_and_weights_are_bf16_qwen3():
    config = json.loads((TARGET / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    reader = CheckpointReader(TARGET)
    assert "lm_head.weight" not in reader  # tied embeddings
    assert reader.read("model.embed_tokens.weight").dtype.name == "bfloat16"
    assert reader.shape("model.embed_tokens.weight") == (config["vocab_size"], config["hidden_size"])
    generation = json.loads((TARGET / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_tokenizer_has_chat_template_and_mask_token():
    tokenizer = _tokenizer()
    vocab_size = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    assert tokenizer.chat_template
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.mask_token == "<|mask|>"
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.mask_token_id < len(tokenizer) < vocab_size
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"):
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1, token
    assert tokenizer.decode(tokenizer(CODE, add_special_tokens=False)["input_ids"]) == CODE


def _records(name: str) -> list[dict]:
    path = DATA / f"{name}.jsonl"
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        assert isinstance(parse_record(line, f"{path}:{number}"), CompletionRecord)
    return [json.loads(line) for line in lines]


def test_toy_data_parses_and_comes_from_disjoint_heldout_files():
    train, evaluation = _records("train"), _records("eval")
    assert len(train) >= 1000 and len(evaluation) >= 32
    for record in train + evaluation:
        assert set(record) == {"prompt", "completion", "source"}
        assert record["prompt"] and record["completion"] and record["source"].endswith(".py")
    train_files = {r["source"] for r in train}
    eval_files = {r["source"] for r in evaluation}
    assert not train_files & eval_files
    # Both come from files held out of the toy target's training; eval files are a fixed sub-split.
    assert {split_of(source) for source in train_files} == {"drafter_train"}
    assert {split_of(source) for source in eval_files} == {"drafter_eval"}


def test_regenerate_reproduces_the_bundled_completions(tmp_path):
    """The bundled data is what `regenerate` writes: the command on the first batch of eval prompts, run as
    tools/make_toy_target.py runs it (configs/toy.py, fp32, one CPU device, the same batch), writes the same
    records byte for byte."""
    lines = (DATA / "eval.jsonl").read_text().splitlines()[:BATCH_SIZE]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["prompt"], "source": r["source"]}) + "\n"
                               for r in map(json.loads, lines)))
    out = tmp_path / "out.jsonl"
    env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}  # one device, as the build
    run = subprocess.run([sys.executable, "-m", "dflash_jax.regenerate", "--config", str(REPO / "configs" / "toy.py"),
                          f"--prompts={prompts}", f"--out={out}", f"--batch_size={BATCH_SIZE}",
                          "--max_new_tokens=128", "--quiet"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert out.read_text().splitlines() == lines


def test_assets_stay_small():
    size = lambda path: sum(f.stat().st_size for f in path.rglob("*") if f.is_file())  # noqa: E731
    assert size(TARGET) < 10.5e6
    assert size(DATA) < 3e6
