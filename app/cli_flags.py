"""The flags of `minserve serve`, generated from `AppArgs` and the engine's config dataclasses.

Each flag is one config key: an `AppArgs` field (`args.KEY` of serve_config.yaml), an
`EngineConfig.from_kwargs` option (`args.engine.KEY`), or an `http_options` key. Its name is the key with
dashes, or vLLM's name where vLLM names the same option otherwise (VLLM_NAMES; the key's own spelling
stays an alias). How a value is read follows the key's type: booleans as `--x`/`--no-x`, `Literal`s as
choices, dicts and dataclasses as a JSON object, and `null` for None where the type allows it. Every flag
defaults to argparse.SUPPRESS, so the parsed namespace holds only the flags given: those are the
overrides of the base config, and nothing else changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from app.builder import AppArgs
from engine.config import EngineConfig

# vLLM's flag where it names one of our options otherwise (vllm/engine/arg_utils.py).
VLLM_NAMES = {"num_blocks": "num-gpu-blocks-override"}
# AppArgs fields without a flag of their own: `model` is the positional MODEL, and `engine` is the
# engine options, each of which has its flag.
APP_FIELDS_NOT_FLAGS = ("model", "engine")
# from_kwargs's name for EngineConfig.speculative (vLLM's)
ENGINE_RENAMES = {"speculative": "speculative_config"}
HTTP_OPTIONS: dict[str, Any] = {"host": str, "port": int}  # serve_config.yaml's http_options
# Keys given as several values after one flag, as vLLM's `--lora-modules a=/x b=/y` (a list in the config)
LIST_FLAGS = {"lora_modules": "NAME=PATH"}


@dataclass(frozen=True)
class Flag:
    key: str  # the config key
    section: str  # "args", "engine" or "http_options"
    hint: Any  # the key's type
    help: str = ""

    @property
    def dest(self) -> str:
        return f"{self.section}.{self.key}"

    @property
    def names(self) -> list[str]:
        own = "--" + self.key.replace("_", "-")
        vllm = VLLM_NAMES.get(self.key)
        return [f"--{vllm}", own] if vllm else [own]


def engine_options() -> dict[str, Any]:
    """EngineConfig.from_kwargs's options and their types: the fields of EngineConfig, with those of its
    component configs (load, scheduler, cache) in their place. `model` is from_kwargs's positional."""
    options: dict[str, Any] = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        if dataclasses.is_dataclass(hint):
            options |= {k: v for k, v in typing.get_type_hints(hint).items() if k != "model"}
        else:
            options[ENGINE_RENAMES.get(name, name)] = hint
    return options


def all_flags() -> list[Flag]:
    flags = [Flag(k, "http_options", t, f"http_options.{k}") for k, t in HTTP_OPTIONS.items()]
    for name, info in AppArgs.model_fields.items():
        if name not in APP_FIELDS_NOT_FLAGS:
            help_text = f"args.{name}" + (f": {info.description}" if info.description else "")
            flags.append(Flag(name, "args", info.annotation, help_text))
    flags += [
        Flag(k, "engine", t, f"args.engine.{k} (engine/config.py)") for k, t in engine_options().items()
    ]
    return flags


def _split_optional(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None is allowed)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(rest) == 1:
            return rest[0], len(rest) < len(typing.get_args(hint))
    return hint, False


def _json_object(text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not JSON ({exc}); give an object such as '{{\"key\": 1}}'"
        ) from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _reader(base: Any, optional: bool) -> Callable[[str], Any]:
    """The argparse `type` for one value of `base`; "null" means None where the key allows it."""
    is_json = base is dict or typing.get_origin(base) is dict or dataclasses.is_dataclass(base)
    read = _json_object if is_json else base

    def convert(text: str) -> Any:
        if optional and text == "null":
            return None
        return read(text)

    convert.__name__ = "JSON" if is_json else getattr(base, "__name__", "value")
    return convert


def add_flags(parser: argparse.ArgumentParser, flags: list[Flag]) -> None:
    """One argument per flag; each stores into `section.key` and only when given."""
    for flag in flags:
        base, optional = _split_optional(flag.hint)
        help_text = flag.help.replace("%", "%%")  # argparse formats help with %
        common: dict[str, Any] = {"dest": flag.dest, "default": argparse.SUPPRESS, "help": help_text}
        if flag.key in LIST_FLAGS:
            parser.add_argument(*flag.names, nargs="+", metavar=LIST_FLAGS[flag.key], **common)
        elif base is bool:
            parser.add_argument(*flag.names, action=argparse.BooleanOptionalAction, **common)
        elif typing.get_origin(base) is Literal:
            names = [*typing.get_args(base), *(["null"] if optional else [])]
            choices = [None if name == "null" else name for name in names]
            metavar = "{" + ",".join(names) + "}"
            reader = _reader(str, optional)
            parser.add_argument(*flag.names, choices=choices, type=reader, metavar=metavar, **common)
        else:
            reader = _reader(base, optional)
            parser.add_argument(*flag.names, type=reader, metavar=reader.__name__.upper(), **common)


def overrides(namespace: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The given flags as {"http_options": {...}, "args": {...}, "engine": {...}}."""
    out: dict[str, dict[str, Any]] = {"http_options": {}, "args": {}, "engine": {}}
    for dest, value in vars(namespace).items():
        section, _, key = dest.partition(".")
        if section in out and key:
            out[section][key] = value
    return out


def flag_of(key: str, flags: list[Flag]) -> str:
    """The flag that sets config key `key` (its first name); "" when none does."""
    return next((f.names[0] for f in flags if f.key == key), "")
