"""Regenerate training data with the target itself: every response in the prompt records becomes the
target's own, as the published DFlash recipes train on. Through serving engines (the way for large targets):

    dflash-jax regenerate --server http://127.0.0.1:8000[,URL...] --prompts prompts.jsonl --out train.jsonl \
        [--max_new_tokens 2048] [--temperature T] [--top_p P] [--seed 0] [--concurrency 64] \
        [--chat_template_kwargs '{"enable_thinking": false}'] [--tokenizer DIR_OR_HUB_ID] [--model NAME]

sends every record to OpenAI-compatible servers (`vllm serve`, SGLang) of the target: chats to
/v1/chat/completions turn by turn, prompt records to /v1/completions, at most --concurrency requests in
flight per server, transient failures retried with backoff (dflash_jax/regeneration/server_job.py). Sampling
the flags do not give is the served model's default (its generation_config); --tokenizer defaults to the
model the server reports (its `root`), or the config's target when --config is given. In JAX on the
accelerators of every process of the job (greedy unless --temperature is given):

    dflash-jax regenerate --config configs/qwen3_8b.py --prompts prompts.jsonl --out train.jsonl \
        [--max_new_tokens 2048] [--batch_size 64] [--temperature 0] [--top_p 1] [--seed 0] [--config.<key>=...]

`python -m dflash_jax.regenerate` is the same command. The target is config.target_dir (a Hugging Face or Orbax
directory; Qwen3 dense or the Qwen3.5/3.6 hybrid) in config.target_dtype, on each process's own devices: its heads,
MLP and vocabulary split over config.mesh.tensor of them (the "tensor" layout: no weight all-gather per token),
the batch's rows over the rest (`decode_mesh`). Several processes (the same command on every host, joined by
jax.distributed as `train` is, config.distributed) each decode their share of the records; process 0 merges
them into --out (regeneration/shares.py). Either path renders chats with --chat_template_kwargs (default:
config.data.chat_template_kwargs, e.g. {"enable_thinking": False}). Input records are the training formats
(`{"prompt"}` or `{"messages"}`; responses optional, see dflash_jax/regeneration/records.py); the output is
training JSONL, the same from either path. Rerun the same command to continue a stopped job (SIGTERM/SIGINT
stop it with exit code 75, in JAX after the window in flight, through servers at once, keeping the records
finished before the first unfinished one): records already written are kept, the rest are appended, each
exactly once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys

import jax

from absl import flags
from absl import logging as absl_logging
from jax.sharding import Mesh
from ml_collections import ConfigDict
from transformers import AutoTokenizer

from dflash_jax.commands import cli
from dflash_jax.data.corpus import check_input_files
from dflash_jax.runtime.errors import CheckpointError, ConfigError, UserError
from dflash_jax.eval.examples import stop_token_ids
from dflash_jax.runtime.paths import absolute, cache_root
from dflash_jax.regeneration.decode import BatchDecoder, Sampling
from dflash_jax.regeneration.job import Summary, count_records, regenerate
from dflash_jax.regeneration.output import ResumableJsonl
from dflash_jax.regeneration.server_client import Retry, Server, ServerUnreachable
from dflash_jax.regeneration import server_job, shares
from dflash_jax.sharding import BATCH_AXES, make_mesh
from dflash_jax.runtime import distributed
from dflash_jax.train.loop import use_compilation_cache
from dflash_jax.train.startup import load_config_target
from dflash_jax.train.validate import parse_chat_template_kwargs
from dflash_jax.weights.hub import pretrained_dir

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_CONFIG = cli.define_config_flag(FLAGS)
_PROMPTS = flags.DEFINE_list("prompts", None, "JSONL prompt files ({'prompt'} or {'messages'} records).",
                             flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "Output JSONL (training records); resumed if it exists.", flag_values=FLAGS)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 2048, "Most tokens per response (a stop token ends it sooner).",
                                flag_values=FLAGS)
_BATCH = flags.DEFINE_integer("batch_size", 64, "Rows decoded together on each process (a multiple of its devices / "
                              "config.mesh.tensor); finished rows are refilled with the next prompts.",
                              flag_values=FLAGS)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.", flag_values=FLAGS)
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling: keep the most likely tokens holding this mass.",
                            flag_values=FLAGS)
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed (a record's response depends on it and its index only).",
                             flag_values=FLAGS)
_QUIET = flags.DEFINE_bool("quiet", False, "No progress bar.", flag_values=FLAGS)
_SERVER = flags.DEFINE_list("server", None, "OpenAI-compatible servers of the target (vLLM, SGLang), e.g. "
                            "http://127.0.0.1:8000: regenerate through them instead of in JAX.", flag_values=FLAGS)
_CONCURRENCY = flags.DEFINE_integer("concurrency", 64, "With --server: most requests in flight per server.",
                                    flag_values=FLAGS)
_TOKENIZER = flags.DEFINE_string("tokenizer", None, "With --server: the target's tokenizer (directory or Hub id); "
                                 "default: the config's target, else the model the server reports.",
                                 flag_values=FLAGS)
_MODEL = flags.DEFINE_string("model", None, "With --server: the served model name (default: the one it serves).",
                             flag_values=FLAGS)
_TEMPLATE_KWARGS = flags.DEFINE_string("chat_template_kwargs", None, "JSON object passed to the chat template "
                                       "(e.g. '{\"enable_thinking\": false}'); default: "
                                       "config.data.chat_template_kwargs.", flag_values=FLAGS)
flags.mark_flags_as_required(["prompts", "out"], flag_values=FLAGS)

STOPPED_EXIT_CODE = os.EX_TEMPFAIL  # stopped by a signal after writing the window in flight: rerun to continue

log = logging.getLogger("dflash_jax.regenerate")


def _check_prompts_and_length(prompts: list[str], max_new_tokens: int) -> None:
    if not prompts:
        raise ConfigError("--prompts is required: one or more JSONL files of prompt records")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    check_input_files(prompts, "--prompts")  # local files or bucket URLs


def decode_mesh(config: ConfigDict) -> Mesh:
    """The mesh a process decodes on: its own devices, config.mesh.tensor of them splitting the target's
    heads, MLP and vocabulary and the rest taking rows (design §14). Decoding reads every weight once per
    token, so the target lies in the "tensor" layout whatever config.target_layout says for training: a whole
    copy per row group, no weight all-gather per token, no traffic between processes."""
    devices = jax.local_devices()
    tensor = config.mesh.tensor
    if tensor < 1 or len(devices) % tensor:
        raise ConfigError(f"config.mesh.tensor ({tensor}) must divide this process's {len(devices)} devices, "
                          f"over which regenerate splits the target")
    return make_mesh(data=len(devices) // tensor, fsdp=1, tensor=tensor, devices=devices)


def run(config: ConfigDict, prompts: list[str], out: str, *, max_new_tokens: int, batch_size: int,
        temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, progress: bool = True) -> Summary:
    """Everything the command does, on every process of the job; raises a UserError (errors.py) on a bad
    setup. Several processes (jax.distributed) each decode their share into a part file; process 0 merges
    the parts into `out` once every share is done (regeneration/shares.py)."""
    if not config.target_dir:
        raise ConfigError("config.target_dir is required: the target whose responses to generate")
    _check_prompts_and_length(prompts, max_new_tokens)
    mesh = decode_mesh(config)
    rows = mesh.shape[BATCH_AXES[0]] * mesh.shape[BATCH_AXES[1]]
    if batch_size < 1 or batch_size % rows:
        raise ConfigError(f"--batch_size ({batch_size}) must be a positive multiple of the decode mesh's data "
                          f"size ({rows}: this process's devices / config.mesh.tensor), which the rows are split over")
    try:
        sampling = Sampling(temperature, top_p, seed)
    except ValueError as error:
        raise ConfigError(f"--{error}") from None
    settings = {"prompts": [absolute(p) for p in prompts], "target_dir": config.target_dir,
                "target_dtype": config.target_dtype, "max_new_tokens": max_new_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
                "chat_template_kwargs": config.data.chat_template_kwargs}
    process, processes = jax.process_index(), jax.process_count()
    # Refuses a foreign file, other settings or another process count's parts before the long load; with
    # several processes, process 0 checks for all and tells them how far a merge got.
    output = merged = None
    if processes == 1:
        shares.check_no_foreign_parts(out, 1)
        output = ResumableJsonl(out, settings)
    else:
        problem, merged_done = None, 0
        if process == 0:
            try:
                shares.check_no_foreign_parts(out, processes)
                merged = ResumableJsonl(out, settings)
                merged_done = merged.records_done
            except UserError as error:
                problem = str(error)
        problem, merged_done = distributed.gather_json([problem, merged_done])[0]
        if problem:
            raise UserError(problem)
        if merged_done == count_records(prompts):  # merged by an earlier run, its parts removed
            return Summary(records_done=merged_done)
        output = ResumableJsonl(shares.part_path(out, process, processes),
                                {**settings, "process": process, "processes": processes})

    target, target_config = load_config_target(config, mesh, "tensor")
    tokenizer = AutoTokenizer.from_pretrained(pretrained_dir(config.tokenizer_dir or config.target_dir))
    stops = stop_token_ids(config.target_dir, tokenizer)
    decoder = BatchDecoder(target, batch_size=batch_size, max_new_tokens=max_new_tokens, stop_token_ids=stops,
                           sampling=sampling, mesh=mesh)
    log.info("regenerating %s -> %s with %s (%s; process %d of %d; decode mesh %s of this process's devices, target "
             "layout \"tensor\": no weight all-gather per token; batch %d refilled %d rows at a time, %s)",
             ", ".join(prompts), out, config.target_dir, config.target_dtype, process, processes, dict(mesh.shape),
             batch_size, decoder.refill_rows,
             "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature}, top_p {sampling.top_p}")
    if output.records_done:
        log.info("resuming: %d records done, %d lines in %s", output.records_done, output.lines, output.path)
    try:
        summary = regenerate(decoder, tokenizer, prompts, output,
                             max_prompt_tokens=target_config.max_position_embeddings - max_new_tokens,
                             chat_template_kwargs=config.data.chat_template_kwargs, progress=progress,
                             process=process, processes=processes)
    finally:
        output.close()  # a bucket's output (or part) complete in the store before process 0 merges
    if processes > 1:
        summary = _joined(summary, distributed.gather_json(dataclasses.asdict(summary)), merged_done)
        if process == 0 and not summary.stopped_by:
            try:
                shares.merge_parts(merged, processes, count_records(prompts))
            finally:
                merged.close()
    return summary


def _joined(own: Summary, every: list[dict], merged_done: int) -> Summary:
    """The job's summary from every process's: counts summed, tokens/s the sum of the processes' rates, a stop
    on any process stopping the merge."""
    joined = Summary(**{key: sum(s[key] for s in every) for key in ("records_done", "written", "skipped_long_prompt",
                                                                   "dropped_empty", "truncated", "generated_tokens")})
    joined.decode_seconds = joined.generated_tokens / max(sum(
        s["generated_tokens"] / s["decode_seconds"] for s in every if s["decode_seconds"]), 1e-9)
    stops = [s["stopped_by"] for s in every if s["stopped_by"]]
    joined.stopped_by = own.stopped_by or (stops and "a stop on another process") or None
    joined.records_done = max(joined.records_done, merged_done)
    return joined


def run_server(urls: list[str], prompts: list[str], out: str, *, max_new_tokens: int, tokenizer: str | None = None,
               model: str | None = None, temperature: float | None = None, top_p: float | None = None,
               seed: int = 0, concurrency: int = 64, chat_template_kwargs: dict | None = None,
               progress: bool = True, retry: Retry = Retry()) -> Summary:
    """Regeneration through the OpenAI-compatible servers at `urls`; raises a UserError on a bad setup.
    temperature/top_p None: the served model's defaults. tokenizer None: the model the server reports."""
    _check_prompts_and_length(prompts, max_new_tokens)
    if concurrency < 1:
        raise ConfigError(f"--concurrency must be >= 1, got {concurrency}")
    try:
        Sampling(0.0 if temperature is None else temperature, 1.0 if top_p is None else top_p, seed)
    except ValueError as error:
        raise ConfigError(f"--{error}") from None
    try:
        servers = [Server(url, retry) for url in urls]
    except ValueError as error:
        raise ConfigError(f"--server: {error}") from None
    card = _served_model(servers, model)
    tokenizer_name = tokenizer or card.get("root") or card["id"]
    try:
        target_tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    except (OSError, ValueError) as error:
        raise CheckpointError(f"tokenizer {tokenizer_name!r} (pass the target's as --tokenizer): "
                              f"{' '.join(str(error).split())[:300]}") from None
    settings = {"prompts": [absolute(p) for p in prompts], "model": card["id"], "tokenizer": tokenizer_name,
                "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "seed": seed,
                "chat_template_kwargs": chat_template_kwargs}
    output = ResumableJsonl(out, settings)
    sampling = server_job.Sampling(card["id"], max_new_tokens, stop_token_ids(tokenizer_name, target_tokenizer),
                                   temperature, top_p, seed, chat_template_kwargs)
    log.info("regenerating %s -> %s through %s (model %s, %d requests in flight per server, %s)",
             ", ".join(prompts), out, ", ".join(map(str, servers)), card["id"], concurrency,
             "the model's default sampling" if temperature is None else f"temperature {temperature}")
    if output.records_done:
        log.info("resuming: %d records done, %d lines in %s", output.records_done, output.lines, out)
    try:
        return server_job.regenerate_through_servers(servers, target_tokenizer, prompts, output, sampling,
                                                     concurrency=concurrency, max_model_len=card.get("max_model_len"),
                                                     progress=progress)
    finally:
        output.close()


def _served_model(servers: list[Server], name: str | None) -> dict:
    """The /v1/models entry of the model every server serves (`name`, or the first listed by the first)."""
    card = None
    for server in servers:
        try:
            listed = server.get("/v1/models").get("data") or []
        except ServerUnreachable as error:
            raise ConfigError(f"--server: no OpenAI-compatible server answered: {error}") from None
        except Exception as error:  # RequestRefused, or an answer without a model list: not that API here
            raise ConfigError(f"--server: {server}/v1/models: {error}") from None
        if name is None:
            if not listed:
                raise ConfigError(f"--server: {server}/v1/models lists no model")
            name = listed[0].get("id")
        match = next((m for m in listed if m.get("id") == name), None)
        if match is None:
            raise ConfigError(f"--server: {server} does not serve {name!r} (it serves "
                              f"{[m.get('id') for m in listed]}); pass --model, or servers of one model")
        card = card or match
    return card


def _template_kwargs(config: ConfigDict | None) -> dict | None:
    if _TEMPLATE_KWARGS.value is None:
        return config.data.chat_template_kwargs if config is not None else None
    return parse_chat_template_kwargs(_TEMPLATE_KWARGS.value, "--chat_template_kwargs")


def main() -> None:
    logging.getLogger("dflash_jax").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)
    config = _CONFIG.value
    if _SERVER.value:
        if FLAGS["batch_size"].present:
            raise ConfigError("--batch_size is for the JAX path; with --server the engine batches (see --concurrency)")
        given = lambda flag: flag.value if FLAGS[flag.name].present else None  # noqa: E731
        summary = run_server(
            _SERVER.value, _PROMPTS.value, _OUT.value, max_new_tokens=_MAX_NEW.value, model=_MODEL.value,
            tokenizer=_TOKENIZER.value or (config and (config.tokenizer_dir or config.target_dir)) or None,
            temperature=given(_TEMPERATURE), top_p=given(_TOP_P), seed=_SEED.value, concurrency=_CONCURRENCY.value,
            chat_template_kwargs=_template_kwargs(config), progress=not _QUIET.value)
    else:
        if config is None:
            raise ConfigError("--config is required (the target to decode in JAX), or --server URL to regenerate "
                              "through a vLLM/SGLang server")
        config.data.chat_template_kwargs = _template_kwargs(config)
        distributed.initialize(config.distributed)  # before any other JAX call
        if jax.process_index() > 0:  # process 0 speaks for the job; the others warn and fail
            logging.getLogger("dflash_jax").setLevel(logging.WARNING)
        # A rerun loads each bucket's programs instead of compiling them (no workdir: under the cache root).
        use_compilation_cache(config, workdir=cache_root())
        summary = run(config, _PROMPTS.value, _OUT.value, max_new_tokens=_MAX_NEW.value, batch_size=_BATCH.value,
                      temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value,
                      progress=not _QUIET.value)
    log.info("%d records written this run (%d input records done); %d tokens at %.0f tokens/s; %d responses cut "
             "at max_new_tokens, %d empty completions dropped, %d prompts too long skipped", summary.written,
             summary.records_done, summary.generated_tokens, summary.tokens_per_second, summary.truncated,
             summary.dropped_empty, summary.skipped_long_prompt)
    if summary.stopped_by:
        log.warning("stopped by %s; rerun the same command to continue", summary.stopped_by)
        sys.exit(STOPPED_EXIT_CODE)


if __name__ == "__main__":
    cli.run(main, FLAGS)
