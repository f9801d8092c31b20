"""The model card (README.md) written beside every drafter export: what the drafter was trained against and on,
how well it drafts, and the commands that serve it (vLLM and SGLang, and on TPUs), as the Hub shows it.

The facts come from the training workdir: the run's config (target, data files), the exported step, and the
newest exact τ / DDTree τ the train loop's eval hook logged to metrics.jsonl at or before that step.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

from dflash_jax.runtime.errors import CheckpointError
from dflash_jax.runtime.paths import as_path
from dflash_jax.models.drafter import DrafterConfig
from dflash_jax.models.layers import rope_type_of
from dflash_jax.runtime.workdir import config_of_step, read_metrics
from dflash_jax.weights.drafter_files import CARD_FILE, serve_command
from dflash_jax.weights.hub import REPO_ID
from dflash_jax.weights.output_dir import OWNER_FILE, write_text
from dflash_jax.weights.tpu_serving import tpu_commands, tpu_note


@dataclasses.dataclass
class TrainingFacts:
    target: str  # the target as the run named it: a directory or a Hub repo id
    data_files: list[str]
    steps: int
    eval_step: int | None = None  # the step of the τ figures below, when the run evaluated
    exact_tau: float | None = None  # pooled over verification steps (design §9.1)
    tau_per_response: float | None = None  # the mean of per-response means, when the run logged it
    ddtree_tau: dict[int, float] = dataclasses.field(default_factory=dict)  # node budget -> pooled τ
    measured_on: str | None = None  # which continuations the hook scored, from the run's config
    row_tokens: int | None = None  # config.data.seq_len: the longest context the drafter trained on


def training_facts(workdir: str | Path, step: int) -> TrainingFacts:
    """What the workdir records about the run up to `step`: the config of the run that trained it
    (config_history.jsonl) and its metrics.jsonl."""
    workdir = as_path(workdir)
    config = config_of_step(workdir, step) or {}
    facts = TrainingFacts(target=config.get("target_dir") or "TARGET",
                          data_files=list(config.get("data", {}).get("train_files") or []), steps=step,
                          row_tokens=config.get("data", {}).get("seq_len"))
    continuation, length = config.get("eval_continuation"), config.get("eval_max_new_tokens")
    if continuation == "generate":
        facts.measured_on = f"the target's greedy continuations of up to {length} tokens"
    elif continuation == "data":
        facts.measured_on = f"the evaluation records' own continuations, up to {length} tokens"
    for record in read_metrics(workdir):
        if "eval/tau" in record and record["step"] <= step:
            facts.eval_step, facts.exact_tau = record["step"], record["eval/tau"]
            facts.tau_per_response = record.get("eval/tau_per_response")
            facts.ddtree_tau = {int(name.rsplit("_", 1)[1]): value for name, value in record.items()
                                if name.startswith("eval/ddtree_tau_") and "per_response" not in name}
    return facts


def sglang_command(target: str, drafter: str, block_size: int) -> str:
    """SGLang's server with the drafter (`--speculative-num-draft-tokens` is the block size)."""
    return (f"python -m sglang.launch_server --model-path {shlex.quote(target)} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {shlex.quote(drafter)} --speculative-num-draft-tokens {block_size}")


def model_card(config: DrafterConfig, facts: TrainingFacts, drafter: str) -> str:
    """The card's text; `drafter` is how users will name the drafter (its directory or Hub repo id)."""
    base_model = f"base_model: {facts.target}\n" if REPO_ID.match(facts.target) else ""
    taus = "not measured (train with eval_every and eval_files, or run `dflash-jax evaluate`)"
    if facts.exact_tau is not None:
        ddtree = ", ".join(f"{tau:.3f} at {budget} nodes" for budget, tau in sorted(facts.ddtree_tau.items()))
        per_response = "" if facts.tau_per_response is None else \
            f" (per-response mean {facts.tau_per_response:.3f})"
        on = "" if facts.measured_on is None else f", on {facts.measured_on}"
        taus = f"exact τ {facts.exact_tau:.3f}{per_response}" + (f"; DDTree τ {ddtree}" if ddtree else "") + \
            f" (step {facts.eval_step}, greedy, block size {config.block_size}{on})"
    rows = [("method", f"`{config.method}`"),
            ("target", f"`{facts.target}`"),
            ("training data", ", ".join(f"`{f}`" for f in facts.data_files) or "not recorded"),
            ("training steps", str(facts.steps)),
            ("block size", str(config.block_size)),
            ("feature layers (`target_layer_ids`)", str(list(config.target_layer_ids))),
            ("drafter layers", f"{config.num_hidden_layers} ({', '.join(config.layer_types)})"),
            ("mask token id", str(config.mask_token_id)),
            ("trained context", "not recorded" if facts.row_tokens is None else
             f"rows of {facts.row_tokens:,} tokens (τ past this length is not trained for)"),
            ("RoPE", _rope(config)),
            ("last evaluation", taus)]
    summary, method_rows = config.drafter_method.card_text(config)
    rows[5:5] = method_rows
    table = "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])
    return f"""---
{base_model}tags:
- {config.method}
- speculative-decoding
---

# {config.drafter_method.title} drafter for {facts.target}

{summary}

{table}

τ is the number of tokens committed per target verification step (accepted drafts plus the target's own
token), pooled over every step of every response, as vLLM's mean acceptance length counts it; the per-response
mean averages each response's own τ instead.

## Serve with vLLM

```bash
{serve_command(facts.target, drafter, config)}
```

{_sglang_section(facts.target, drafter, config)}
{_tpu_section(facts.target, drafter, config)}"""


def _rope(config: DrafterConfig) -> str:
    """The drafter's RoPE as trained, and which engines compute it so (long context: design §8.6)."""
    scaling = dict(config.rope_scaling or {})
    kind = rope_type_of(scaling)
    text = f"θ {config.rope_theta:g}"
    if kind == "yarn":
        text += (f", YaRN ×{scaling.get('factor')} over an original window of "
                 f"{scaling.get('original_max_position_embeddings')} positions")
    elif kind == "linear":
        text += f", linear ×{scaling.get('factor')}"
    windows = (f"; sliding window {config.sliding_window} on {config.layer_types.count('sliding_attention')} of "
               f"{config.num_hidden_layers} layers" if "sliding_attention" in config.layer_types else "")
    return (f"{text}{windows}. vLLM 0.32 (GPU and CPU) reads both from config.json as trained; vLLM TPU 0.32 "
            f"does not (below)")


def _sglang_section(target: str, drafter: str, config: DrafterConfig) -> str:
    """SGLang's DFLASH algorithm serves the z-lab layout only, so a DSpark card has no SGLang command."""
    if not config.drafter_method.sglang_serves:
        return ""
    return f"""## Serve with SGLang

```bash
{sglang_command(target, drafter, config.block_size)}
```
"""


def _tpu_section(target: str, drafter: str, config: DrafterConfig) -> str:
    commands = tpu_commands(target, drafter, config, serve_command(target, drafter, config))
    block = "\n".join(["", "```bash", *commands, "```", ""]) if commands else ""
    return f"""## Serve on TPUs

{tpu_note(config)}
{block}"""


def write_model_card(out_dir: str | Path, config: DrafterConfig, facts: TrainingFacts, drafter: str) -> Path:
    path = Path(out_dir) / CARD_FILE
    write_text(path, model_card(config, facts, drafter))
    return path


def push_to_hub(directory: str | Path, repo_id: str) -> str:
    """Upload the export directory (weights, config, card) to the Hub model repo `repo_id`, creating it if
    needed; returns its address. Needs the network and a token (hf auth login)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model",
                          commit_message="DFlash drafter exported by dflash_jax",
                          ignore_patterns=[OWNER_FILE])  # this machine's bookkeeping, not part of the model
    except (HfHubHTTPError, OSError) as error:  # OSError: offline mode, no connection
        raise CheckpointError(f"pushing {directory} to the Hub repo {repo_id!r} failed: "
                              f"{' '.join(str(error).split())}") from None
    return f"https://huggingface.co/{repo_id}"
