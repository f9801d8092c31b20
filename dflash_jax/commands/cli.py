"""The command line: `dflash-jax <command> [flags]`, and the one way every command runs.

Each command is a module of commands/ with its own absl flags (`FLAGS = flags.FlagValues()`, so that importing
several commands never clashes) and a `main()`; `dflash-jax train ...` and `python -m dflash_jax.train ...` (an
entry shim that calls `run_module`) are the same command. `run` gives every command the same conventions:

- `--help` prints the command's usage, where its config fields are listed, and its flags (exit 0);
- a command with a training config takes `--config FILE` (or the name of a packaged recipe, `--config qwen27b`
  for configs/qwen27b.py, installed as dflash_jax.configs) plus `--config.<field>=<value>` overrides
  (`define_config_flag`), an unknown field is named with the one to use, and `--print_config` prints the
  resolved config as JSON and exits;
- an error the user can fix (a bad flag, config, file or checkpoint: `errors.UserError`) is one line
  `error: ...` on stderr and exit code 2, never a traceback;
- every storage client takes the same endpoint, and remote storage that stops answering is one line
  `error: storage outage: ...` and exit code 74, retryable, at most 10 s after the first outage the command
  meets (runtime/storage.py, design §7.2).

Adding a command is one line in COMMANDS.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import sys
import textwrap
from collections.abc import Callable, Sequence

from absl import app, flags
from ml_collections import config_flags

from dflash_jax.runtime import storage
from dflash_jax.runtime.errors import UserError
from dflash_jax.train.validate import check_overrides, resolve_chat_template_kwargs

PROGRAM = "dflash-jax"
# command -> the module whose `main()` runs it with its `FLAGS` (`python -m <module>` runs it the same way).
COMMANDS = {
    "regenerate": "dflash_jax.commands.regenerate",
    "train": "dflash_jax.commands.train",
    "evaluate": "dflash_jax.commands.evaluate",
    "export": "dflash_jax.commands.export",
    "convert": "dflash_jax.commands.convert",
    "plan": "dflash_jax.commands.plan",
}
USER_ERROR_EXIT = 2
CONFIG_FIELDS = "dflash_jax/train/config.py"
_HELP_FLAGS = ("-h", "--help", "--helpshort", "-help")


class _DictParser(flags.ArgumentParser):
    """`--config.<field>={...}` for a dict field (config.drafter.rope_scaling): JSON or a Python dict literal."""

    def parse(self, argument):
        if not isinstance(argument, str):
            return argument
        try:
            value = json.loads(argument)
        except ValueError:
            try:
                value = ast.literal_eval(argument)
            except (SyntaxError, ValueError):
                value = None
        if not isinstance(value, dict):
            raise ValueError(f"expected a dict such as '{{\"rope_type\": \"yarn\", \"factor\": 4.0}}', "
                             f"got {argument!r}")
        return value

    def flag_type(self):
        return "dict"


config_flags.register_flag_parser_for_type(dict, _DictParser())


def define_config_flag(flag_values: flags.FlagValues) -> flags.FlagHolder:
    """`--config FILE` (a file returning a training config, or a packaged recipe's name; `file.py:arg` passes arg
    to its get_config) with `--config.<field>=<value>` overrides, and `--print_config`."""
    holder = config_flags.DEFINE_config_file(
        "config", None, f"A config file (e.g. configs/tiny.py) or a packaged recipe's name (e.g. qwen27b); fields "
        f"and defaults: {CONFIG_FIELDS}.",
        flag_values=flag_values, lock_config=True)
    flags.DEFINE_bool("print_config", False, "Print the resolved config (file and overrides) as JSON and exit.",
                      flag_values=flag_values)
    return holder


def mark_given_mesh(flag_values: flags.FlagValues) -> None:
    """A mesh given by `--config.mesh.*` flags is used as given, default values or not (config.choose_mesh)."""
    config = flag_values.config
    overrides = config_flags.get_override_values(flag_values["config"])
    if "choose_mesh" in config and config.choose_mesh is None and any(key.startswith("mesh.") for key in overrides):
        config.choose_mesh = False


def packaged_config_path(value: str) -> str:
    """`--config`'s value with a packaged recipe's name (`qwen27b`, `toy:arg`) replaced by its file; a path is
    kept as given. A bare name that is neither a file nor a packaged recipe is a UserError listing the recipes."""
    name, colon, argument = value.partition(":")
    if os.path.exists(name) or "/" in name or name.endswith(".py"):
        return value
    spec = importlib.util.find_spec(f"dflash_jax.configs.{name}") if name.isidentifier() else None
    if spec is None:
        import dflash_jax.configs

        names = sorted(module.name for module in pkgutil.iter_modules(dflash_jax.configs.__path__))
        raise UserError(f"--config {name}: no such file, nor a packaged config (those are: {', '.join(names)})")
    return spec.origin + colon + argument


def _with_packaged_configs(args: list[str]) -> list[str]:
    """`--config NAME` / `--config=NAME` in args with NAME resolved by `packaged_config_path`."""
    resolved = list(args)
    for i, arg in enumerate(resolved):
        if arg == "--config" and i + 1 < len(resolved):
            resolved[i + 1] = packaged_config_path(resolved[i + 1])
        elif arg.startswith("--config="):
            resolved[i] = "--config=" + packaged_config_path(arg[len("--config="):])
    return resolved


def fail(message: str) -> None:
    """Report a user error as one line and exit with code 2."""
    sys.stderr.write(f"error: {' '.join(str(message).split())}\n")
    # Work the error abandoned (e.g. Orbax's concurrent reads of the other arrays of a damaged checkpoint) can
    # be collected at exit and print its own traceback after the one line; it says nothing the line does not.
    sys.unraisablehook = _quiet_abandoned_coroutines
    sys.exit(USER_ERROR_EXIT)


def _quiet_abandoned_coroutines(unraisable) -> None:
    if not inspect.iscoroutine(unraisable.object):
        sys.__unraisablehook__(unraisable)


def run(main: Callable[[], None], command_flags: flags.FlagValues, argv: Sequence[str] | None = None) -> None:
    """Parse `command_flags` from argv (default sys.argv) and run `main` (see the module docstring)."""
    argv = list(sys.argv if argv is None else argv)
    module = sys.modules[main.__module__]
    has_config = "config" in command_flags

    def parse(args: list[str]) -> list[str]:
        if any(arg in _HELP_FLAGS for arg in args[1:]):
            print(_usage(_program(module, args[0]), module.__doc__, command_flags))
            sys.exit(0)
        try:
            if has_config:
                check_overrides(args[1:])  # an unknown field names the one to use (absl would raise a traceback)
                args = args[:1] + _with_packaged_configs(args[1:])
            rest = command_flags(args)
            flags.FLAGS(args[:1])  # absl's own flags (logging) keep their defaults
            if has_config and command_flags.config is not None:  # None: optional and not given
                command_flags.config.keys()  # a config file that failed to load raises here, not in main
                resolve_chat_template_kwargs(command_flags.config)  # text from the command line -> a dict
                mark_given_mesh(command_flags)
        except UserError as error:
            fail(str(error))
        except flags.Error as error:
            fail(f"{_without_traceback(str(error))} (see --help)")
        except OSError as error:  # the config file could not be read
            fail(f"--config: {str(error).strip().splitlines()[-1].strip()}")
        if len(rest) > 1:
            fail(f"unexpected arguments {' '.join(rest[1:])!r}; every setting is a --flag (see --help)")
        if has_config and command_flags.print_config:
            if command_flags.config is None:
                fail("--print_config needs --config")
            print(command_flags.config.to_json_best_effort(indent=2, sort_keys=True))
            sys.exit(0)
        return rest

    def guarded(_) -> None:
        storage.connect()
        storage.end_commands_after_outages()
        if has_config and command_flags.config is not None:
            storage.configure(command_flags.config.get("storage"))
        try:
            main()
        except UserError as error:
            fail(str(error))
        except storage.StorageOutage as error:
            storage.report_and_exit(str(error), storage.EXIT_STORAGE_OUTAGE)

    app.run(guarded, argv=argv, flags_parser=parse)


def _without_traceback(message: str) -> str:
    """An error raised inside a config file's get_config reaches absl as the whole traceback's text; its
    last line (the exception) is what the user needs, after the flag it came from."""
    if "Traceback (most recent call last)" not in message:
        return message
    return f"{message.split(': Error whilst parsing')[0]}: {message.strip().splitlines()[-1].strip()}"


def _program(module, argv0: str) -> str:
    """How the user ran the command: `dflash-jax <command>`, `python -m <module>` or a script path."""
    if module.__name__ == "__main__" and module.__spec__ is not None:
        return f"python -m {module.__spec__.name.removesuffix('.__main__')}"
    return argv0


def _usage(program: str, doc: str | None, command_flags: flags.FlagValues) -> str:
    if "config" in command_flags:
        config = (f"Config: --config FILE, then --config.<field>=<value> for any field listed (with its default "
                  f"and meaning) in {CONFIG_FIELDS}; --print_config prints the result and exits.")
    else:
        config = f"This command reads no training config (those fields are listed in {CONFIG_FIELDS})."
    help_lines = command_flags.get_help(include_special_flags=False).splitlines()
    flag_lines = [line for line in help_lines if line.startswith("  ")]  # without the module headers
    return "\n\n".join(part for part in (
        f"usage: {program} [flags]", (doc or "").strip(), textwrap.fill(config, 110),
        "\n".join(["flags:", *flag_lines])) if part)


def _overview() -> str:
    return "\n".join([f"usage: {PROGRAM} <command> [flags]   ({PROGRAM} <command> --help for a command's flags)",
                      "", "commands:", *(f"  {name:<10} python -m dflash_jax.{name}" for name in COMMANDS)])


def run_module(name: str) -> None:
    """`python -m dflash_jax.<name>`: the entry shims (dflash_jax/<name>.py, train/__main__.py, plan/__main__.py)
    run COMMANDS[name] under that name."""
    command = importlib.import_module(COMMANDS[name])
    run(command.main, command.FLAGS, [f"python -m dflash_jax.{name}", *sys.argv[1:]])


def main() -> None:
    """The `dflash-jax` console script: dispatch to COMMANDS[argv[1]] with the rest of the command line."""
    args = sys.argv[1:]
    if not args or args[0] in _HELP_FLAGS:
        print(_overview())
        sys.exit(0 if args else USER_ERROR_EXIT)
    name = args[0]
    if name not in COMMANDS:
        fail(f"unknown command {name!r}; the commands are {', '.join(COMMANDS)} (see {PROGRAM} --help)")
    command = importlib.import_module(COMMANDS[name])
    run(command.main, command.FLAGS, [f"{PROGRAM} {name}", *args[1:]])
