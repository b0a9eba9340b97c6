"""The shell commands shown in README.md and docs/*.md, and how each is checked without running it.

Shown: every line of a ```bash / ```sh / ```shell block, the `$ ` lines of a ```console block,
indented `$ ` lines, and inline code that starts with `python -m`, `make` or `serve run|deploy`
(after any VAR=value). Backslash continuations are joined and `# comments` dropped.

Run as a script (`python tests/docs_commands.py < jobs.json`), this file is the child process that
checks the `python -m` and `serve` commands: one process, so torch and Ray are imported once, and no
module state leaks into the test process. It prints one line, "ANSWERS " and a JSON list with one
answer per job: "" when the check passed, else why not.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE_LANGS = {"bash", "sh", "shell", "console"}
INLINE_COMMAND = re.compile(
    r"^(?:[A-Za-z_]\w*=\S+\s+)*(?:\S*/)?(?:python3? -m \S|make [a-z]|serve (?:run|deploy) \S)"
)
SHELL_STOPS = {">", ">>", "2>", "|", "&&", "||", ";", "&"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")


@dataclass(frozen=True)
class Shown:
    where: str  # "docs/operations.md:129"
    text: str  # as shown, continuations joined


def doc_paths() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown_commands(name: str, text: str) -> list[Shown]:
    """The commands of one markdown file: fenced shell blocks, `$ ` lines, inline command spans."""
    found: list[Shown] = []
    lang: str | None = None
    pending, prose = "", []
    for no, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            lang = None if lang is not None else (line.strip()[3:].strip() or "text")
            prose.append("")
            continue
        prose.append(line if lang is None else "")
        if lang is None:
            if re.match(r"\s+\$ ", line):
                found.append(Shown(f"{name}:{no}", line.strip()[2:]))
            continue
        if lang not in FENCE_LANGS or (lang == "console" and not (pending or line.startswith("$ "))):
            continue
        line = line[2:] if lang == "console" and not pending else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        command, pending = (pending + line).strip(), ""
        if tokens(command):
            found.append(Shown(f"{name}:{no}", command))
    return found + _inline_commands(name, "\n".join(prose))


def _inline_commands(name: str, prose: str) -> list[Shown]:
    """Inline code spans that start like a command (they may wrap onto the next line)."""
    found = []
    for match in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(match.group(1).split())
        if INLINE_COMMAND.match(span):
            found.append(Shown(f"{name}:{prose.count(chr(10), 0, match.start()) + 1}", span))
    return found


def tokens(command: str) -> list[str]:
    """The command's words: `$(...)` replaced by one word, env assignments and redirections dropped."""
    words = shlex.split(re.sub(r"\$\([^)]*\)", "SUBST", command), comments=True)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    stop = next((i for i, word in enumerate(words) if word in SHELL_STOPS), len(words))
    words = words[:stop]
    if words and words[0].rsplit("/", 1)[-1] in ("python", "python3"):
        words[0] = "python"
    elif words and words[0].startswith(".venv/bin/"):
        words[0] = words[0].removeprefix(".venv/bin/")
    return words


class _Parsed(Exception):
    """Raised right after a module's argparse parser accepted its arguments: the program never starts."""


@contextlib.contextmanager
def _stop_after_parsing():
    real_parse, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_args(self, args=None, namespace=None):
        depth[0] += 1
        try:
            real_parse(self, args, namespace)
        finally:
            depth[0] -= 1
        raise _Parsed

    def parse_known_args(self, args=None, namespace=None):
        if depth[0]:  # inside parse_args, or a subcommand's parser
            return real_known(self, args, namespace)
        real_known(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = (
        parse_args,
        parse_known_args,
    )
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real_parse, real_known


def parse_only(module: str, argv: list[str]) -> str:
    """'' when MODULE exists and its argparse parser accepts ARGV (a module without argparse: exists)."""
    try:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
    except ImportError as exc:
        return f"no module {module}: {exc}"
    if spec is None or spec.origin is None:
        return f"no module {module}"
    if "ArgumentParser" not in Path(spec.origin).read_text():
        return ""
    err, saved_argv = io.StringIO(), sys.argv
    sys.argv = [module, *argv]
    try:
        with (
            _stop_after_parsing(),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            runpy.run_module(spec.name, run_name="__main__", alter_sys=True)
    except _Parsed:
        return ""
    except SystemExit as exc:
        return f"exit {exc.code}: {err.getvalue().strip()[-400:]}"
    except Exception as exc:  # noqa: BLE001 - any failure before parsing is the answer
        return f"{type(exc).__name__}: {exc}"
    finally:
        sys.argv = saved_argv
    return "the module ran to its end without parsing its arguments"


def serve_config_builds(config: str) -> str:
    """'' when CONFIG parses and its first application builds as `serve run` builds it (args validated)."""
    import yaml

    from tests.serving_fixtures import _build

    try:
        app = yaml.safe_load((ROOT / config).read_text())["applications"][0]
        _build(app["import_path"], app.get("args") or {})
    except Exception as exc:  # noqa: BLE001 - the reason is the answer
        return f"{type(exc).__name__}: {exc}"
    return ""


def _child_main() -> None:
    sys.path.insert(0, str(ROOT))
    answers = [
        parse_only(job["module"], job["argv"]) if "module" in job else serve_config_builds(job["config"])
        for job in json.loads(sys.stdin.read())
    ]
    print("ANSWERS " + json.dumps(answers), flush=True)


if __name__ == "__main__":
    _child_main()
