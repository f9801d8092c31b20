"""Exact τ during training: the `evaluate` hook of `dflash_jax.train.loop.train` (every config.eval_every steps)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax.eval.examples import read_examples, stop_token_ids, with_greedy_continuations
from dflash_jax.eval.exact_tau import DEFAULT_BUDGETS, evaluate_drafter
from dflash_jax.eval.generate import SpeculativeGenerator, generator_shapes
from dflash_jax.eval.report import flat_metrics
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import read_target_config


def make_train_evaluator(config: ConfigDict, *, budgets: Sequence[int] = DEFAULT_BUDGETS
                         ) -> Callable[[int, object, object], dict[str, float]]:
    """evaluate(step, drafter, target) -> flat metrics (tau, acc_k, ddtree_tau_<budget>, ...; see
    `report.flat_metrics`) on the first config.eval_prompts records of config.data.eval_files.

    The measurement is `dflash-jax evaluate`'s with its defaults (design §9): continuations are the target's
    own greedy ones, up to config.eval_max_new_tokens tokens, generated once at the first call (the target is
    frozen), or with config.eval_continuation = "data" the records' own, cut to that length. The examples
    are tokenized once, here; the forward compiles at the first call.
    """
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    max_new_tokens, generate = config.eval_max_new_tokens, config.eval_continuation == "generate"
    examples = read_examples(config.data.eval_files, tokenizer, config.eval_prompts, max_continuation=max_new_tokens,
                             chat_template_kwargs=config.data.chat_template_kwargs,
                             max_positions=read_target_config(config.target_dir).max_position_embeddings,
                             generated=max_new_tokens if generate else 0)
    stops = stop_token_ids(config.target_dir, tokenizer)
    continued = []  # the greedy examples, once made

    def evaluate(step: int, drafter, target) -> dict[str, float]:
        del step  # the same examples every time
        if generate and not continued:
            shapes = generator_shapes([len(e.prompt_ids) for e in examples], max_new_tokens, block_size=1)
            continued.extend(with_greedy_continuations(SpeculativeGenerator(target, None, **shapes), examples,
                                                       max_new_tokens, stops))
        return flat_metrics(evaluate_drafter(target, drafter, continued or examples, budgets=budgets,
                                             vocab_chunk=config.loss.vocab_chunk))

    return evaluate
