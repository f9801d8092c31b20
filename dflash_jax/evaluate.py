r"""Evaluate a drafter (design §9): exact greedy τ, its histogram, per-slot acceptance, DDTree τ, against an
untrained baseline; optionally (--speed) the decode tokens/s of plain greedy, speculative and DDTree decoding.

    dflash-jax evaluate --config configs/qwen3_8b.py --workdir /ckpt/run1 \
        [--prompts eval.jsonl] [--json out.json] [--drafter EXPORT_DIR] [--step N] [--num_prompts 32] \
        [--continuation generate|data] [--max_new_tokens N] [--budgets 8,22] [--speed] [--config.<key>=...]

`python -m dflash_jax.evaluate` is the same command. The drafter is the latest (or --step) checkpoint of the
training workdir, or an exported z-lab directory (--drafter). Prompts: JSONL records as for training (default
config.data.eval_files); `generate` continues each prompt with the target's own decode-cached greedy decoding
(either target family), `data` uses the record's completion / last assistant turn.

On a pod, the same command on every host: the processes join through jax.distributed (config.distributed), each
evaluates its share of the prompts on its own devices (config.mesh within a host), and the figures join those
of every process; process 0 prints them and writes --json (design §9.5).
"""

from __future__ import annotations

import json

import jax
from absl import flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax import cli
from dflash_jax.errors import ConfigError
from dflash_jax.eval.examples import read_examples, stop_token_ids, with_greedy_continuations
from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.exact_tau import DEFAULT_BUDGETS, evaluate_drafter, process_share
from dflash_jax.eval.generate import SpeculativeGenerator, benchmark, generator_shapes
from dflash_jax.eval.report import format_result, format_speed
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.paths import as_path
from dflash_jax.sharding import replicated
from dflash_jax.train import distributed
from dflash_jax.train.loop import use_compilation_cache
from dflash_jax.train.validate import dtype_of, mesh_from_config
from dflash_jax.weights.drafter_files import load_drafter
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import load_target, read_target_config

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: drafter_config.json and checkpoints/.",
                               flag_values=FLAGS)
_DRAFTER = flags.DEFINE_string("drafter", None, "An exported drafter directory (z-lab layout) instead of --workdir.",
                               flag_values=FLAGS)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).", flag_values=FLAGS)
_PROMPTS = flags.DEFINE_list("prompts", None, "JSONL prompt files (default: config.data.eval_files).",
                             flag_values=FLAGS)
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", None, "Records to evaluate (default: config.eval_prompts).",
                                    flag_values=FLAGS)
_CONTINUATION = flags.DEFINE_enum("continuation", None, ["generate", "data"],
                                  "generate: the target's greedy continuation; data: the record's own (default: "
                                  "config.eval_continuation, as the train-time evaluation).", flag_values=FLAGS)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Generated (or kept data) continuation tokens per prompt "
                                "(default: config.eval_max_new_tokens).", flag_values=FLAGS)
_BUDGETS = flags.DEFINE_list("budgets", ["8", "22"], "DDTree node budgets.", flag_values=FLAGS)
flags.register_validator("budgets", lambda values: bool(values) and all(v.isdigit() and int(v) > 0 for v in values),
                         "--budgets must be one or more positive integers, e.g. --budgets=8,22", flag_values=FLAGS)
_SPEED = flags.DEFINE_bool("speed", False, "Also time plain greedy, speculative and DDTree decoding (the largest "
                           "--budgets).",
                           flag_values=FLAGS)
_JSON = flags.DEFINE_string("json", None, "Write every figure to this JSON file.", flag_values=FLAGS)
flags.mark_flags_as_required(["config"], flag_values=FLAGS)


def placed(drafter: Drafter, config: DrafterConfig, dtype, sharding) -> Drafter:
    """The drafter's weights on `sharding`, computing in `dtype` as in training."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0), dtype=dtype)))
    return nnx.merge(graphdef, jax.device_put(nnx.state(drafter), sharding))


def run(config: ConfigDict, *, workdir: str | None, drafter_dir: str | None = None, step: int | None = None,
        prompts: list[str] | None = None, num_prompts: int | None = None, continuation: str | None = None,
        max_new_tokens: int | None = None, budgets: tuple[int, ...] = DEFAULT_BUDGETS, speed: bool = False,
        log=print) -> dict:
    """Everything the CLI prints, as a dict (see the module docstring). Prompts, continuations and budgets
    default to the train-time evaluation's (config.data.eval_files, eval_prompts, eval_continuation,
    eval_max_new_tokens; `train_hook`), so both measure the same τ."""
    continuation = config.eval_continuation if continuation is None else continuation
    max_new_tokens = config.eval_max_new_tokens if max_new_tokens is None else max_new_tokens
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if not config.target_dir:
        raise ConfigError("config.target_dir is required: the target the drafter was trained against")
    if not (workdir or drafter_dir):
        raise ConfigError("give --workdir (a training run) or --drafter (an exported drafter directory)")
    if speed and jax.process_count() > 1:
        raise ConfigError("--speed times the decoders of one process: run it on one host")
    # The prompts are read (and refused, if bad) before the target's weights load, which takes minutes.
    target_config = read_target_config(config.target_dir)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    files = prompts or config.data.eval_files
    examples = read_examples(files, tokenizer, num_prompts or config.eval_prompts, max_continuation=max_new_tokens,
                             chat_template_kwargs=config.data.chat_template_kwargs,
                             max_positions=target_config.max_position_embeddings,
                             generated=max_new_tokens if continuation == "generate" or speed else 0)
    # The drafter is small: it loads, and is checked against the target's config, before the target does.
    drafter, drafter_config, source = load_drafter(workdir, drafter_dir, step)
    expected = (target_config.num_hidden_layers, target_config.vocab_size, target_config.hidden_size)
    if (drafter_config.num_target_layers, drafter_config.vocab_size, drafter_config.hidden_size) != expected:
        raise ConfigError(f"the drafter ({source}) was made for a target with (layers, vocab, hidden) = "
                          f"{(drafter_config.num_target_layers, drafter_config.vocab_size, drafter_config.hidden_size)}"
                          f", but {config.target_dir} has {expected}")
    # Each process evaluates its own share of the prompts on its own devices (design §9.5).
    mesh = mesh_from_config(config, jax.local_devices())
    share = process_share(examples)
    # config.attention_impl picks the backend of the target's full forward (exact τ); the decode-cached
    # generator and the drafters here run in XLA.
    target, _ = load_target(config.target_dir, param_dtype=dtype_of(config.target_dtype), mesh=mesh,
                            attention_impl=config.attention_impl)
    compute = dtype_of(config.compute_dtype)
    drafter = placed(drafter, drafter_config, compute, replicated(mesh))
    baseline = placed(Drafter(drafter_config, rngs=nnx.Rngs(0)), drafter_config, compute, replicated(mesh))

    stops = stop_token_ids(config.target_dir, tokenizer)
    plain = None
    if continuation == "generate" or speed:
        # Room for a verification pass of the block or of the largest DDTree, whichever is wider.
        shapes = generator_shapes([len(e.prompt_ids) for e in examples], max_new_tokens,
                                  max(drafter_config.block_size, 1 + max(budgets)))
        plain = SpeculativeGenerator(target, None, **shapes)
    if continuation == "generate":
        log(f"generating greedy continuations of {len(share)} prompts (up to {max_new_tokens} tokens)"
            + (f" on each of {jax.process_count()} processes" if jax.process_count() > 1 else ""))
        share = with_greedy_continuations(plain, share, max_new_tokens, stops)

    results = {"target_dir": config.target_dir, "drafter": source, "prompts": list(files),
               "continuation": continuation, "max_new_tokens": max_new_tokens}
    for name, model in (("trained", drafter), ("untrained", baseline)):
        results[name] = evaluate_drafter(target, model, share, budgets=budgets, vocab_chunk=config.loss.vocab_chunk,
                                         across_processes=True)
        log(format_result(f"{name} drafter", results[name]))
    if speed:
        speculative = SpeculativeGenerator(target, drafter, **shapes)
        tree = DDTreeGenerator(target, drafter, budget=max(budgets), **shapes)
        results["speed"], _, _ = benchmark(plain, speculative, [e.prompt_ids for e in share], max_new_tokens,
                                           stops, ddtree=tree)
        log(format_speed(results["speed"]))
    return results


def main() -> None:
    absl_logging.set_verbosity(absl_logging.WARNING)
    config = _CONFIG.value
    distributed.initialize(config.distributed)  # before any other JAX call
    use_compilation_cache(config, _WORKDIR.value)
    first = jax.process_index() == 0  # of several processes, one prints and writes
    results = run(config, workdir=_WORKDIR.value, drafter_dir=_DRAFTER.value, step=_STEP.value,
                  prompts=_PROMPTS.value, num_prompts=_NUM_PROMPTS.value, continuation=_CONTINUATION.value,
                  max_new_tokens=_MAX_NEW.value, budgets=tuple(int(b) for b in _BUDGETS.value), speed=_SPEED.value,
                  log=print if first else lambda _: None)
    if _JSON.value and first:
        as_path(_JSON.value).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    cli.run(main, FLAGS)
