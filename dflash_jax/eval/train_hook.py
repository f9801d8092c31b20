"""Exact τ during training: the `evaluate` hook of `dflash_jax.train.loop.train` (every config.eval_every steps)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax.eval.examples import read_examples
from dflash_jax.eval.exact_tau import DEFAULT_BUDGETS, evaluate_drafter
from dflash_jax.eval.report import flat_metrics
from dflash_jax.weights.hub import pretrained_dir
from dflash_jax.weights.targets import read_target_config


def make_train_evaluator(config: ConfigDict, *, budgets: Sequence[int] = DEFAULT_BUDGETS,
                         max_continuation: int = 512) -> Callable[[int, object, object], dict[str, float]]:
    """evaluate(step, drafter, target) -> flat metrics (tau, acc_k, ddtree_tau_<budget>, ...; see
    `report.flat_metrics`) on the first config.eval_prompts records of config.data.eval_files.

    Continuations are the records' own (target-regenerated) ones, cut to max_continuation tokens: no
    generation, so it works for every target kind; `greedy_agreement` says how closely they follow the
    target's greedy decoding. The examples are tokenized once, here; the forward compiles at the first call.
    """
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    examples = read_examples(config.data.eval_files, tokenizer, config.eval_prompts, max_continuation=max_continuation,
                             chat_template_kwargs=config.data.chat_template_kwargs,
                             max_positions=read_target_config(config.target_dir).max_position_embeddings)

    def evaluate(step: int, drafter, target) -> dict[str, float]:
        del step  # the same examples every time
        return flat_metrics(evaluate_drafter(target, drafter, examples, budgets=budgets,
                                             vocab_chunk=config.loss.vocab_chunk))

    return evaluate
