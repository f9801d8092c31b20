"""Convert a Hugging Face target checkpoint (Qwen3, Qwen3.5/3.6, and their MoE variants) into an Orbax/tensorstore target directory.

    dflash-jax convert --hf_dir /ckpt/Qwen3.6-27B --out /ckpt/Qwen3.6-27B-orbax [--dtype bfloat16]

`python -m dflash_jax.convert` (or `python convert/hf_to_orbax.py`) is the same command. The result loads
wherever a target directory is accepted (`load_target`, `config.target_dir`), restored onto the training mesh
shard by shard. Weights stream one layer at a time (peak host memory about one layer's tensors: for a
mixture-of-experts target, one layer's experts); config.json and the tokenizer files are copied alongside.
"""

from __future__ import annotations

import jax.numpy as jnp
from absl import flags

from dflash_jax.commands import cli
from dflash_jax.weights.orbax_target import write_orbax_target

FLAGS = flags.FlagValues()  # this command's own flags (cli.py)
_HF_DIR = flags.DEFINE_string("hf_dir", None, "HF checkpoint directory: config.json + safetensors.", flag_values=FLAGS)
_OUT = flags.DEFINE_string("out", None, "Output directory (must be empty or absent unless --overwrite).",
                           flag_values=FLAGS)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32", "float16"], "Storage dtype of the weights.",
                           flag_values=FLAGS)
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace an earlier Orbax target in --out (a directory "
                                "holding anything else is refused).", flag_values=FLAGS)
flags.mark_flags_as_required(["hf_dir", "out"], flag_values=FLAGS)


def main() -> None:
    out = write_orbax_target(_HF_DIR.value, _OUT.value, dtype=jnp.dtype(_DTYPE.value), overwrite=_OVERWRITE.value)
    print(f"wrote the Orbax target {out} ({_DTYPE.value}); use it as --config.target_dir={out}")


if __name__ == "__main__":
    cli.run(main, FLAGS)
