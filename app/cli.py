"""`minserve serve MODEL [flags]`: serve_config.yaml's application, with MODEL and the flags merged in.

The config is serve_config.yaml (or `--config FILE`) with `args.model`, `args.*`, `args.engine.*` and
`http_options.*` overridden by MODEL and the flags given (app/cli_flags.py); everything else, the app
builder, the controller's runtime_env and the proxy location, is the file's. It is checked here before
anything starts (AppArgs, EngineConfig.from_kwargs, the checkpoint directory), so a bad value is an
argparse error (exit 2) naming its flag instead of a failed deployment.

It then runs through Ray Serve's own `serve run` command, in this process, on a temporary copy of the
config: the code `.venv/bin/serve run` runs, so signals and logs are exactly its own (Ctrl-C shuts
Serve down; Ray's logs stream to the terminal), where a reimplementation on Serve's Python API could drift
from it. `--print-config` prints the config as YAML instead and exits: `serve run` on that file starts
the same application.
"""

from __future__ import annotations

import argparse
import copy
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from app.builder import AppArgs
from app.cli_flags import Flag, add_flags, all_flags, flag_of, overrides
from app.tp_placement import check_num_gpus
from engine.config import EngineConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "serve_config.yaml"


class UsageError(Exception):
    """A bad flag value or base config: `where` names the flag (or the config key) to fix."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where, self.message = where, message


def build_parser(flags: list[Flag]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The `minserve` parser and its `serve` subcommand's parser."""
    parser = argparse.ArgumentParser(prog="minserve", description="minserve, an LLM inference server")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="serve MODEL (serve_config.yaml's application, with these flags merged in)",
        description="Start the application of serve_config.yaml with MODEL and the given flags; "
        "Ctrl-C stops it. Flags left out keep the config file's values.",
        usage="minserve serve MODEL [--port P] [--max-model-len L] [--speculative-config JSON] ... "
        "(--help lists every flag)",
        allow_abbrev=False,  # a misspelt flag is an error, never a prefix match
    )
    serve.add_argument("model", metavar="MODEL", help="local HF-format checkpoint directory (args.model)")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="the base config file")
    serve.add_argument("--print-config", action="store_true", help="print the config file and exit")
    add_flags(serve, flags)
    return parser, serve


def merged_config(ns: argparse.Namespace) -> dict[str, Any]:
    """The base config with MODEL (as an absolute path) and the given flags merged in."""
    try:
        config = yaml.safe_load(Path(ns.config).read_text())
        app = config["applications"][0]
    except (OSError, yaml.YAMLError, TypeError, KeyError, IndexError) as exc:
        raise UsageError("--config", f"{ns.config} is no serve config with an application ({exc!r})") from exc
    given = overrides(ns)
    config["http_options"] = {**(config.get("http_options") or {}), **given["http_options"]}
    args = {**(app.get("args") or {}), **given["args"]}
    args["model"] = os.path.abspath(os.path.expanduser(ns.model))
    args["engine"] = {**(args.get("engine") or {}), **given["engine"]}
    app["args"] = args
    return config


def check(config: dict[str, Any], flags: list[Flag], source: Path) -> None:
    """What `serve run` would find only once deployed: bad args, engine options, checkpoint or port."""
    args = config["applications"][0]["args"]
    if not os.path.isfile(os.path.join(args["model"], "config.json")):
        where = f"no checkpoint at {args['model']} (no config.json)"
        raise UsageError(
            "MODEL", f"{where}; give a local HF-format directory (tiny test model: `make model`)"
        )
    port = config["http_options"].get("port")
    if not (isinstance(port, int) and 0 < port < 65536):
        raise UsageError(flag_of("port", flags), f"{port!r} is no TCP port; give one in 1..65535")
    try:
        AppArgs.model_validate(args)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"])
        raise UsageError(flag_of(key, flags) or f"{source}: args.{key}", error["msg"]) from exc
    try:
        engine = EngineConfig.from_kwargs(args["model"], **copy.deepcopy(args["engine"]))
    except (TypeError, ValueError) as exc:
        key = str(exc).split(":")[0].split(".")[0]
        raise UsageError(flag_of(key, flags) or f"{source}: args.engine", str(exc)) from exc
    try:
        check_num_gpus(args.get("num_gpus"), engine.tensor_parallel_size)
    except ValueError as exc:
        raise UsageError(flag_of("num_gpus", flags), str(exc)) from exc


def load(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Parse `argv` (after `minserve`) and build the checked config; argparse errors exit 2."""
    flags = all_flags()
    parser, serve = build_parser(flags)
    ns = parser.parse_args(argv)
    try:
        config = merged_config(ns)
        check(config, flags, Path(ns.config))
    except UsageError as exc:
        serve.error(f"argument {exc.where}: {exc.message}")
    return ns, config


def as_yaml(config: dict[str, Any], argv: list[str]) -> str:
    header = f"# {shlex.join(['minserve', *argv])}\n# Start it with: serve run FILE\n"
    return header + yaml.safe_dump(config, sort_keys=False)


def run(config: dict[str, Any]) -> None:
    """`serve run` on a temporary copy of `config`, in the foreground until Ctrl-C."""
    from ray.serve.scripts import cli as serve_cli

    fd, path = tempfile.mkstemp(prefix="minserve-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    try:
        serve_cli.main(["run", path], prog_name="serve")  # exits through SystemExit, as `serve` does
    finally:
        os.unlink(path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ns, config = load(argv)
    if ns.print_config:
        sys.stdout.write(as_yaml(config, argv))
        return
    run(config)


if __name__ == "__main__":
    main()
