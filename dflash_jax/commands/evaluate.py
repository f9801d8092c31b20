r"""Evaluate a drafter (design §9): exact greedy τ, its histogram, per-slot acceptance, DDTree τ, against an
untrained baseline; optionally (--speed) the decode tokens/s of plain greedy, speculative and DDTree decoding.

    dflash-jax evaluate --config configs/qwen3_8b.py --workdir /ckpt/run1 \
        [--prompts eval.jsonl] [--json out.json] [--drafter EXPORT_DIR] [--step N] [--num_prompts 32] \
        [--continuation generate|data] [--max_new_tokens N] [--budgets 8,22] [--speed] \
        [--context_bins 4K,8K,16K,32K] [--config.<key>=...]
    dflash-jax evaluate ... --benchmark gsm8k,math500,humaneval,mbpp,mt-bench,alpaca [--num_prompts 128]

`python -m dflash_jax.evaluate` is the same command. The drafter is the latest (or --step) checkpoint of the
training workdir, or an exported z-lab directory (--drafter). Prompts: JSONL records as for training (default
config.data.eval_files); `generate` continues each prompt with the target's own decode-cached greedy decoding
(either target family), `data` uses the record's completion / last assistant turn. --benchmark instead
builds the prompts of the published DFlash/DDTree benchmarks (eval/benchmarks.py) and prints a table of τ per
benchmark on the target's greedy answers (design §9.6). τ is also reported by the prompts' context length
(--context_bins; design §9.7). With `generate`, a record may be a prompt alone (a `prompt` without completion,
or a chat ending with the user's turn).

On a pod, the same command on every host: the processes join through jax.distributed (config.distributed), each
evaluates its share of the prompts on its own devices (config.mesh within a host), and the figures join those
of every process; process 0 prints them and writes --json (design §9.5). --benchmark and --speed run on one host.
"""

from __future__ import annotations

import json

import jax
from absl import flags
from absl import logging as absl_logging
from flax import nnx
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax.commands import cli
from dflash_jax.runtime.errors import ConfigError
from dflash_jax.eval import benchmarks as bench, context_bins
from dflash_jax.eval.examples import read_examples, stop_token_ids, with_greedy_continuations
from dflash_jax.eval.ddtree import ddtree_defined
from dflash_jax.eval.ddtree_decode import DDTreeGenerator
from dflash_jax.eval.exact_tau import DEFAULT_BUDGETS, evaluate_drafter, process_share
from dflash_jax.eval.generate import SpeculativeGenerator, benchmark, generator_shapes
from dflash_jax.eval.report import format_benchmark_table, format_result, format_speed
from dflash_jax.models.drafter import Drafter, DrafterConfig
from dflash_jax.runtime.paths import as_path
from dflash_jax.sharding import replicated
from dflash_jax.runtime import distributed
from dflash_jax.train.loop import use_compilation_cache
from dflash_jax.train.startup import load_config_target
from dflash_jax.train.validate import dtype_of, mesh_from_config
from dflash_jax.train.checkpoint import load_drafter
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import read_target_config

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir: drafter_config.json and checkpoints/.",
                               flag_values=FLAGS)
_DRAFTER = flags.DEFINE_string("drafter", None, "An exported drafter directory (z-lab layout) instead of --workdir.",
                               flag_values=FLAGS)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step of --workdir (default: the latest).", flag_values=FLAGS)
_PROMPTS = flags.DEFINE_list("prompts", None, "JSONL prompt files (default: config.data.eval_files).",
                             flag_values=FLAGS)
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", None, "Records to evaluate (default: config.eval_prompts); with "
                                    f"--benchmark, prompts per benchmark (default {bench.SAMPLES}).",
                                    flag_values=FLAGS)
_BENCHMARK = flags.DEFINE_list("benchmark", None, "Benchmarks instead of --prompts, any of "
                               f"{','.join(bench.BENCHMARKS)}; NAME=PATH reads NAME's dataset from a local file or "
                               "directory instead of its Hub id's snapshot in the local Hugging Face cache.",
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
_CONTEXT_BINS = flags.DEFINE_list("context_bins", list(context_bins.DEFAULT_EDGES),
                                  "Upper edges of the context-length bins τ is also reported by (prompt tokens; "
                                  "4K = 4096): the default gives 0-4K, 4K-8K, 8K-16K, 16K-32K and 32K+.",
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
        benchmarks: list[str] | None = None, context_edges: tuple[int, ...] | None = None, log=print) -> dict:
    """Everything the CLI prints, as a dict (see the module docstring). Prompts, continuations and budgets
    default to the train-time evaluation's (config.data.eval_files, eval_prompts, eval_continuation,
    eval_max_new_tokens; `train_hook`), so both measure the same τ. `benchmarks` (`--benchmark` entries) puts
    the trained drafter's figures per benchmark under "benchmarks" instead (num_prompts: samples of each).
    context_edges: τ is also reported per context-length bin (eval/context_bins.py; default its bins)."""
    if benchmarks and (prompts or continuation == "data"):
        raise ConfigError("--benchmark makes its own prompts and scores the target's answers to them: it takes "
                          "neither --prompts nor --continuation=data")
    continuation = "generate" if benchmarks else config.eval_continuation if continuation is None else continuation
    max_new_tokens = config.eval_max_new_tokens if max_new_tokens is None else max_new_tokens
    if context_edges is None:
        context_edges = context_bins.parse_edges(context_bins.DEFAULT_EDGES)
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if not config.target_dir:
        raise ConfigError("config.target_dir is required: the target the drafter was trained against")
    if not (workdir or drafter_dir):
        raise ConfigError("give --workdir (a training run) or --drafter (an exported drafter directory)")
    if speed and jax.process_count() > 1:
        raise ConfigError("--speed times the decoders of one process: run it on one host")
    if benchmarks and jax.process_count() > 1:
        raise ConfigError("--benchmark answers each conversation's turns in turn on one process: run it on one host")
    # The prompts are read (and refused, if bad) before the target's weights load, which takes minutes.
    target_config = read_target_config(config.target_dir)
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    files = prompts or config.data.eval_files
    if benchmarks:
        suites = bench.read_benchmarks(benchmarks, num_prompts or bench.SAMPLES)
        template_kwargs = bench.template_kwargs(config.data.chat_template_kwargs)
        lengths = bench.first_turn_lengths(suites, tokenizer, template_kwargs, max_new_tokens,
                                           target_config.max_position_embeddings)
    else:
        examples = read_examples(files, tokenizer, num_prompts or config.eval_prompts,
                                 max_continuation=max_new_tokens, chat_template_kwargs=config.data.chat_template_kwargs,
                                 max_positions=target_config.max_position_embeddings,
                                 generated=max_new_tokens if continuation == "generate" or speed else 0,
                                 generate=continuation == "generate")
    # The drafter is small: it loads, and is checked against the target's config, before the target does.
    drafter, drafter_config, source = load_drafter(workdir, drafter_dir, step)
    expected = (target_config.num_hidden_layers, target_config.vocab_size, target_config.hidden_size)
    if (drafter_config.num_target_layers, drafter_config.vocab_size, drafter_config.hidden_size) != expected:
        raise ConfigError(f"the drafter ({source}) was made for a target with (layers, vocab, hidden) = "
                          f"{(drafter_config.num_target_layers, drafter_config.vocab_size, drafter_config.hidden_size)}"
                          f", but {config.target_dir} has {expected}")
    # Each process evaluates its own share of the prompts on its own devices (design §9.5).
    mesh = mesh_from_config(config, jax.local_devices())
    # config.attention_impl picks the backend of the target's full forward (exact τ); the decode-cached
    # generator and the drafters here run in XLA.
    target, _ = load_config_target(config, mesh, "fsdp", config.attention_impl)
    compute = dtype_of(config.compute_dtype)
    drafter = placed(drafter, drafter_config, compute, replicated(mesh))
    stops = stop_token_ids(config.target_dir, tokenizer)
    if benchmarks:
        scores = _benchmark_scores(suites, target, drafter, tokenizer, template_kwargs, max(lengths), stops,
                                   max_new_tokens=max_new_tokens, budgets=budgets, speed=speed,
                                   max_positions=target_config.max_position_embeddings,
                                   vocab_chunk=config.loss.vocab_chunk, context_edges=context_edges, log=log)
        log(format_benchmark_table(scores))
        return {"target_dir": config.target_dir, "drafter": source, "max_new_tokens": max_new_tokens,
                "benchmarks": scores}

    share = process_share(examples)
    baseline = placed(Drafter(drafter_config, rngs=nnx.Rngs(0)), drafter_config, compute, replicated(mesh))
    plain = None
    if continuation == "generate" or speed:
        shapes = _shapes(examples, max_new_tokens, drafter_config, budgets)
        plain = SpeculativeGenerator(target, None, **shapes)
    if continuation == "generate":
        log(f"generating greedy continuations of {len(share)} prompts (up to {max_new_tokens} tokens)"
            + (f" on each of {jax.process_count()} processes" if jax.process_count() > 1 else ""))
        share = with_greedy_continuations(plain, share, max_new_tokens, stops)

    results = {"target_dir": config.target_dir, "drafter": source, "prompts": list(files),
               "continuation": continuation, "max_new_tokens": max_new_tokens}
    for name, model in (("trained", drafter), ("untrained", baseline)):
        results[name] = evaluate_drafter(target, model, share, budgets=budgets, vocab_chunk=config.loss.vocab_chunk,
                                         across_processes=True, context_edges=context_edges)
        log(format_result(f"{name} drafter", results[name]))
    log(context_bins.format_context_table({name: results[name] for name in ("trained", "untrained")}))
    if speed:
        speculative, tree = _drafting_decoders(target, drafter, shapes, budgets)
        results["speed"], _, _ = benchmark(plain, speculative, [e.prompt_ids for e in share], max_new_tokens,
                                           stops, ddtree=tree)
        log(format_speed(results["speed"]))
    return results


def _shapes(examples, max_new_tokens: int, drafter_config: DrafterConfig, budgets) -> dict[str, int]:
    """Generator shapes that fit every prompt, with room for a verification pass of the block or of the
    largest DDTree, whichever is wider: one compile per decoder."""
    return generator_shapes([len(e.prompt_ids) for e in examples], max_new_tokens,
                            1 + max(drafter_config.draft_length, *budgets))


def _drafting_decoders(target, drafter: Drafter, shapes: dict[str, int], budgets):
    """The speculative and the DDTree (largest budget; None where DDTree is not defined, design §18.2)
    generators that --speed times beside plain greedy."""
    tree = DDTreeGenerator(target, drafter, budget=max(budgets), **shapes) if ddtree_defined(drafter.config) else None
    return SpeculativeGenerator(target, drafter, **shapes), tree


def _benchmark_scores(suites, target, drafter: Drafter, tokenizer, template_kwargs: dict, longest_prompt: int,
                      stops, *, max_new_tokens: int, budgets, speed: bool, max_positions: int, vocab_chunk: int,
                      context_edges: tuple[int, ...], log) -> dict:
    """Per benchmark (design §9.6): the target's greedy answers to every turn, the drafter's exact and DDTree τ
    on them and, with `speed`, the three decoders timed on the same prompts (built once for all benchmarks)."""
    answers = bench.GreedyAnswers(target, max_new_tokens, stops, longest_prompt)
    turns, scores = {}, {}
    for suite in suites:
        log(f"{suite.name}: the target's greedy answers to {len(suite.conversations)} prompts ({suite.source})")
        turns[suite.name] = bench.answered_turns(suite, tokenizer, template_kwargs, answers, max_new_tokens,
                                                 max_positions)
        scores[suite.name] = {"dataset": suite.source, "prompts": len(suite.conversations),
                              **evaluate_drafter(target, drafter, turns[suite.name], budgets=budgets,
                                                 vocab_chunk=vocab_chunk, context_edges=context_edges)}
        if len(scores[suite.name]["by_context"]) > 1:  # the prompts span several context-length bins
            log(f"{suite.name}: " + context_bins.format_context_table({"trained": scores[suite.name]}))
    if speed:
        shapes = _shapes([e for examples in turns.values() for e in examples], max_new_tokens, drafter.config,
                         budgets)
        plain = SpeculativeGenerator(target, None, **shapes)
        speculative, tree = _drafting_decoders(target, drafter, shapes, budgets)
        for name, examples in turns.items():
            scores[name]["speed"], _, _ = benchmark(plain, speculative, [e.prompt_ids for e in examples],
                                                    max_new_tokens, stops, ddtree=tree)
    return scores


def _context_edges(values: list[str]) -> tuple[int, ...]:
    try:
        return context_bins.parse_edges(values)
    except ValueError as error:
        raise ConfigError(f"--context_bins: {error}") from None


def main() -> None:
    absl_logging.set_verbosity(absl_logging.WARNING)
    config = _CONFIG.value
    distributed.initialize(config.distributed)  # before any other JAX call
    use_compilation_cache(config, _WORKDIR.value)
    first = jax.process_index() == 0  # of several processes, one prints and writes
    results = run(config, workdir=_WORKDIR.value, drafter_dir=_DRAFTER.value, step=_STEP.value,
                  prompts=_PROMPTS.value, num_prompts=_NUM_PROMPTS.value, continuation=_CONTINUATION.value,
                  max_new_tokens=_MAX_NEW.value, budgets=tuple(int(b) for b in _BUDGETS.value), speed=_SPEED.value,
                  benchmarks=_BENCHMARK.value, context_edges=_context_edges(_CONTEXT_BINS.value),
                  log=print if first else lambda _: None)
    if _JSON.value and first:
        as_path(_JSON.value).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    cli.run(main, FLAGS)
