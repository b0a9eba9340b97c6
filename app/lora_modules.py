"""The adapters a server offers under their own model names, and the name -> adapter table the ingress keeps.

`lora_modules` (serve_config.yaml's `args`, as vLLM's --lora-modules) comes in any of vLLM's forms:
  {name: path, ...}                      serve_config.yaml's natural form;
  ["name=path", ...]                     vLLM's command line form (`minserve serve --lora-modules a=/x`);
  [{"name": ..., "path": ...}, ...]      vLLM's JSON form (also as JSON text in a list entry).
`parse_lora_modules` turns each into {name: absolute path} and checks, in the driver, that every path
holds a PEFT adapter (adapter_config.json), so a typo fails `serve run` at once. The weights themselves
are checked against the base model by the engine when a replica first loads the adapter.

`LoraTable` is the ingress's table: every request naming an adapter gets its LoRARequest here, and
runtime loads (POST /v1/load_lora_adapter) add to it. lora_int_id: the static modules are 1..N in
config order (the same in every ingress replica); each runtime load takes a fresh id, never reused, so
one id always means one (name, path) and the engine's prefix cache, keyed by it, never mixes an
adapter's KV with that of an earlier adapter of the same name.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engine import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"


def check_adapter_dir(path: str, where: str) -> str:
    """The absolute path of a PEFT adapter directory; ValueError naming `where` when it is not one."""
    full = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(full, ADAPTER_CONFIG)):
        raise ValueError(
            f"{where}: no PEFT adapter at {full} ({ADAPTER_CONFIG} missing): give the directory that "
            "peft's save_pretrained wrote (adapter_config.json + adapter_model.safetensors)"
        )
    return full


def _entry(item: Any, where: str) -> tuple[str, str]:
    """(name, path) of one list entry: "name=path", {"name", "path"} or that object as JSON text."""
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc}); give 'name=path' or a JSON object") from exc
    if isinstance(item, str):
        name, sep, path = item.partition("=")
        if not (sep and name.strip() and path.strip()):
            raise ValueError(f"{where}: {item!r} is not 'name=path'")
        return name.strip(), path.strip()
    if isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("path"), str):
        return item["name"], item["path"]
    raise ValueError(f"{where}: give 'name=path' or an object with 'name' and 'path', got {item!r}")


def parse_lora_modules(value: Any, base_name: str | None = None) -> dict[str, str]:
    """{name: absolute adapter path} from any of the forms above (None: no adapters)."""
    if value is None:
        return {}
    if isinstance(value, dict):
        pairs = [(str(k), v, f"args.lora_modules.{k}") for k, v in value.items()]
    elif isinstance(value, list):
        wheres = [f"args.lora_modules[{i}]" for i in range(len(value))]
        pairs = [(*_entry(item, where), where) for item, where in zip(value, wheres, strict=True)]
    else:
        kind = type(value).__name__
        raise ValueError(f"args.lora_modules: give a mapping name -> path or a list, got {kind}")
    modules: dict[str, str] = {}
    for name, path, where in pairs:
        if not isinstance(path, str):
            raise ValueError(f"{where}: the adapter path must be a string, got {path!r}")
        if name in modules or name == base_name:
            what = "the base model's name" if name == base_name else "a name given twice"
            raise ValueError(f"{where}: {name!r} is {what}; every adapter needs a model name of its own")
        modules[name] = check_adapter_dir(path, where)
    return modules


class LoraTable:
    """name -> LoRARequest of the adapters this ingress serves."""

    def __init__(self, modules: dict[str, str]):
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        for name, path in modules.items():
            self.add(name, path)

    def add(self, name: str, path: str) -> LoRARequest:
        request = self.new_request(name, path)
        self.put(request)
        return request

    def new_request(self, name: str, path: str) -> LoRARequest:
        """A LoRARequest with a fresh id, not in the table yet (`put` adds it once it was checked)."""
        request = LoRARequest(lora_name=name, lora_int_id=self._next_id, lora_path=path)
        self._next_id += 1
        return request

    def put(self, request: LoRARequest) -> None:
        self._adapters[request.lora_name] = request

    def get(self, name: str) -> LoRARequest | None:
        return self._adapters.get(name)

    def remove(self, name: str) -> LoRARequest | None:
        return self._adapters.pop(name, None)

    def __iter__(self):
        return iter(list(self._adapters.values()))

    def __len__(self) -> int:
        return len(self._adapters)
