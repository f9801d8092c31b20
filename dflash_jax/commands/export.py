"""Export a trained drafter from a training workdir in the z-lab layout vLLM serves (design §10).

    dflash-jax export --workdir /ckpt/run1 --out /ckpt/run1-dflash [--step N] [--overwrite] \
        [--push_to_hub OWNER/NAME]

`python -m dflash_jax.export` (or `python convert/export_drafter.py`) is the same command. Reads
<workdir>/drafter_config.json and the drafter params of <workdir>/checkpoints/<step> (the latest readable step
unless --step), writes <out>/config.json + <out>/model.safetensors (bf16) and a model card <out>/README.md
(target, data, steps, block size, feature layers, the last exact/DDTree τ, the vLLM and SGLang commands; the
target and data of the run that trained that step, from <workdir>/config_history.jsonl), prints the `vllm serve`
line and what serves it on TPUs (weights/tpu_serving.py), and with --push_to_hub uploads <out> to that Hub repo.
"""

from __future__ import annotations

import os

from absl import flags

from dflash_jax.commands import cli
from dflash_jax.runtime.paths import absolute
from dflash_jax.runtime.paths import as_path
from dflash_jax.train.checkpoint import restore_drafter
from dflash_jax.weights.drafter_files import check_out_dir, export_drafter, serve_command
from dflash_jax.weights.model_card import CARD_FILE, push_to_hub, training_facts, write_model_card
from dflash_jax.weights.output_dir import staged_output
from dflash_jax.weights.tpu_serving import tpu_commands, tpu_note

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's --workdir (a local path or a bucket URI such as "
                               "gs://bucket/run).", flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "Export directory (config.json, model.safetensors); a local path or a bucket URI.", flag_values=FLAGS)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step to export (default: the latest readable one).",
                             flag_values=FLAGS)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an earlier export in --out (a directory holding anything "
                               "else is refused).", flag_values=FLAGS)
_PUSH = flags.DEFINE_string("push_to_hub", None, "Then upload --out to this Hugging Face Hub model repo (owner/name; "
                            "needs hf auth login).", flag_values=FLAGS)
flags.mark_flags_as_required(["workdir", "out"], flag_values=FLAGS)


def export(workdir: str, out: str, *, step: int | None = None, overwrite: bool = False,
           push_to_hub_repo: str | None = None) -> None:
    """What the command does, with its flags as arguments; a user error raises `errors.UserError`."""
    workdir, out = as_path(workdir), os.fspath(out)
    check_out_dir(out, overwrite, inputs=[workdir])  # before the (possibly long) restore
    drafter, config, step = restore_drafter(workdir, step)
    facts = training_facts(workdir, step)
    with staged_output(out) as local_out:  # a bucket --out: written locally, then uploaded
        export_drafter(drafter, config, local_out, overwrite=overwrite, inputs=[workdir],
                       target=facts.target)
        write_model_card(local_out, config, facts, drafter=push_to_hub_repo or absolute(out))
        if push_to_hub_repo:
            print(f"uploaded to {push_to_hub(local_out, push_to_hub_repo)}")
    print(f"exported step {step} of {workdir} to {out} (model card: {os.path.join(out, CARD_FILE)})")
    vllm_line = serve_command(facts.target, absolute(out), config)
    print("serve it with:\n  " + vllm_line)
    print("on TPUs: " + tpu_note(config))
    for line in tpu_commands(facts.target, absolute(out), config, vllm_line):
        print("  " + line)


def main() -> None:
    export(_WORKDIR.value, _OUT.value, step=_STEP.value, overwrite=_OVERWRITE.value, push_to_hub_repo=_PUSH.value)


if __name__ == "__main__":
    cli.run(main, FLAGS)
