"""Qwen3.6-35B-A3B, long context: configs/qwen36_35b_a3b.py's drafter and schedule on rows of 65,536 tokens
(design §4's long rows), the long-context counterpart of configs/qwen27b_long.py.

    dflash-jax train --config qwen36_35b_a3b_long --workdir /ckpt/dflash-qwen36-35b-a3b-long \\
        --config.target_dir=/ckpt/Qwen3.6-35B-A3B --config.data.train_files=/data/agent_traces.jsonl

Each choice and its source:
- rows of 65,536 tokens: the target is native to 262,144 positions, so the rows need no RoPE scaling;
- 2048 anchors a row (data.max_anchors; stride 32), as configs/qwen27b_long.py: the drafter's 32,768 block
  queries are half the row's tokens;
- the five sliding layers keep z-lab's W = 4096 and the sixth is full (the drafter as z-lab serves it: the
  engines honour its windows, and a windowed layer's cost does not grow with the context);
- the drafter's RoPE stays plain θ = 1e7 without scaling: it is trained at the positions it is served at, up to
  the row length.

On v5p-64 a 65,536-token row fits a chip without splitting it (deviceless plan, mesh at its defaults:
`dflash-jax plan --config qwen36_35b_a3b_long --topology v5p-64`, tensor layout on fsdp 16 x tensor 2, 50.15 of
95 GiB, 1.17-2.4 s a step; bench/RESULTS.md "Long rows"); at 131,072 tokens the plan splits each row over
context = 2 (fsdp 16, 87.17 of 95 GiB). Chips whose memory a row outgrows split it over
`--config.mesh.context` (docs/scaling_and_launching.md, design §19), which `plan` and `train` choose by themselves
for a mesh left at its defaults.
"""

from dflash_jax.configs import qwen36_35b_a3b
from dflash_jax.configs.qwen27b_long import long_rows

target_config = qwen36_35b_a3b.target_config  # the target's text-model shapes (configs/qwen36_35b_a3b.py)


def get_config():
    return long_rows(qwen36_35b_a3b.get_config())
