"""Qwen3.6-27B, long context: configs/qwen27b.py's drafter and schedule on rows of 65,536 tokens (design §4's
long rows), for agents' prompts of 16K-170K tokens, where drafters trained on 4K rows lose their acceptance.

    dflash-jax train --config qwen27b_long --workdir /ckpt/dflash-qwen27b-long \\
        --config.target_dir=/ckpt/Qwen3.6-27B --config.data.train_files=/data/agent_traces.jsonl

Each choice and its source:
- rows of 65,536 tokens: the target is native to 262,144 positions (its config's max_position_embeddings), so
  the rows need no RoPE scaling; documents longer than a row are split with half a row of context (design §4);
- 2048 anchors a row (data.max_anchors; stride 32): the 4K recipe's 512 anchors would leave one block per 128
  tokens; 2048 keep the drafter's 32,768 block queries at half the row's tokens, so the step stays the target's
  (the 4K recipe has twice as many queries as tokens);
- the four sliding layers keep W = 2048 and the fifth is full, as z-lab's Qwen3.6 drafters (the serving engines
  honour the windows, and a windowed layer's cost does not grow with the context: long-context notes, dflash
  #126); the full layer reads the whole 64K prefix;
- the drafter's RoPE stays plain θ = 1e7 without scaling: it is trained at the positions it is served at, up to
  the row length.

On a v5p-64 slice one 131,072-token row of this recipe fits a chip without splitting it (deviceless plan of the
27B step with its 2048 anchors: 54.5 GiB of 95 in the fsdp layout, bench/RESULTS.md "Long rows"); chips of less
memory split the row over `--config.mesh.context` (docs/scaling_and_launching.md, design §19), which `plan`
chooses by itself.
"""

from dflash_jax.configs import qwen27b

target_config = qwen27b.target_config  # the target's text-model shapes (configs/qwen27b.py)


def long_rows(config):
    """A recipe's config on this file's rows: 65,536 tokens with 2048 anchors (the reasons above)."""
    config.data.seq_len = 65536
    config.data.max_anchors = 2048
    return config


def get_config():
    return long_rows(qwen27b.get_config())
