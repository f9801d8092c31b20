"""Regenerate training data with the target itself: every response in the prompt records becomes the
target's own (greedy by default), as the published DFlash recipes train on.

    dflash-jax regenerate --config configs/qwen3_8b.py --prompts prompts.jsonl --out train.jsonl \
        [--max_new_tokens 2048] [--batch_size 64] [--temperature 0] [--top_p 1] [--seed 0] [--config.<key>=...]

`python -m dflash_jax.regenerate` is the same command. The target is config.target_dir (a Hugging Face or Orbax
directory; Qwen3 dense or the Qwen3.5/3.6 hybrid) in config.target_dtype, its weights and the batch split over the
mesh of config.mesh; chats are rendered with config.data.chat_template_kwargs (e.g. {"enable_thinking": False}).
Input records are the training formats (`{"prompt"}` or `{"messages"}`; responses optional, see
dflash_jax/regeneration/records.py); the output is training JSONL. Rerun the same command to continue a stopped job (SIGTERM/SIGINT stop it after the batch in
flight, exit code 75): records already written are kept, the rest are appended, each exactly once.
"""

from __future__ import annotations

import logging
import os
import sys

from absl import flags
from absl import logging as absl_logging
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax import cli
from dflash_jax.data.corpus import check_input_files
from dflash_jax.errors import ConfigError
from dflash_jax.eval.examples import stop_token_ids
from dflash_jax.paths import absolute
from dflash_jax.regeneration.decode import BatchDecoder, Sampling
from dflash_jax.regeneration.job import Summary, regenerate
from dflash_jax.regeneration.output import ResumableJsonl
from dflash_jax.sharding import BATCH_AXES
from dflash_jax.train.validate import dtype_of, mesh_from_config
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import load_target

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_PROMPTS = flags.DEFINE_list("prompts", None, "JSONL prompt files ({'prompt'} or {'messages'} records).",
                             flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "Output JSONL (training records); resumed if it exists.", flag_values=FLAGS)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 2048, "Most tokens per response (a stop token ends it sooner).",
                                flag_values=FLAGS)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Prompts decoded together (a multiple of the mesh's data x fsdp).",
                              flag_values=FLAGS)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", flag_values=FLAGS)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens holding this mass.",
                            flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (a record's response depends on it and its index only).",
                             flag_values=FLAGS)
_QUIET = flags.DEFINE_bool("quiet", False, "No progress bar.", flag_values=FLAGS)
flags.mark_flags_as_required(["config", "prompts", "out"], flag_values=FLAGS)

STOPPED_EXIT_CODE = os.EX_TEMPFAIL  # stopped by a signal after writing the batch in flight: rerun to continue

log = logging.getLogger("dflash_jax.regenerate")


def run(config: ConfigDict, prompts: list[str], out: str, *, max_new_tokens: int, batch_size: int,
        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, progress: bool = True) -> Summary:
    """Everything the command does; raises a UserError (errors.py) on a bad setup."""
    if not config.target_dir:
        raise ConfigError("config.target_dir is required: the target whose responses to generate")
    if not prompts:
        raise ConfigError("--prompts is required: one or more JSONL files of prompt records")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    mesh = mesh_from_config(config)
    rows = mesh.shape[BATCH_AXES[0]] * mesh.shape[BATCH_AXES[1]]
    if batch_size < 1 or batch_size % rows:
        raise ConfigError(f"--batch_size ({batch_size}) must be a positive multiple of the mesh's data x fsdp "
                          f"size ({rows}), which the rows are split over")
    try:
        sampling = Sampling(temperature, top_p, seed)
    except ValueError as error:
        raise ConfigError(f"--{error}") from None
    check_input_files(prompts, "--prompts")
    settings = {"prompts": [absolute(p) for p in prompts], "target_dir": config.target_dir,
                "target_dtype": config.target_dtype, "max_new_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
                "chat_template_kwargs": config.data.chat_template_kwargs}
    output = ResumableJsonl(out, settings)  # refuses a foreign file or other settings before the long load

    target, target_config = load_target(config.target_dir, param_dtype=dtype_of(config.target_dtype), mesh=mesh)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    stops = stop_token_ids(config.target_dir, tokenizer)
    decoder = BatchDecoder(target, max_new_tokens=max_new_tokens, stop_token_ids=stops, sampling=sampling, mesh=mesh)
    log.info("regenerating %s -> %s with %s (%s, mesh %s, batch %d, %s)", ", ".join(prompts), out,
             config.target_dir, config.target_dtype, dict(mesh.shape), batch_size,
             "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature}, top_p {sampling.top_p}")
    if output.records_done:
        log.info("resuming: %d records done, %d lines in %s", output.records_done, output.lines, out)
    return regenerate(decoder, tokenizer, prompts, output, batch_size=batch_size,
                      max_prompt_tokens=target_config.max_position_embeddings - max_new_tokens,
                      chat_template_kwargs=config.data.chat_template_kwargs, progress=progress)


def main() -> None:
    logging.getLogger("dflash_jax").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)
    summary = run(_CONFIG.value, _PROMPTS.value, _OUT.value, max_new_tokens=_MAX_NEW.value, batch_size=_BATCH.value,
                  temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value, progress=not _QUIET.value)
    log.info("%d records written this run (%d input records done); %d tokens at %.0f tokens/s; %d responses cut "
             "at max_new_tokens, %d empty completions dropped, %d prompts too long skipped", summary.written,
             summary.records_done, summary.generated_tokens, summary.tokens_per_second, summary.truncated,
             summary.dropped_empty, summary.skipped_long_prompt)
    if summary.stopped_by:
        log.warning("stopped by %s; rerun the same command to continue", summary.stopped_by)
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    cli.run(main, FLAGS)
