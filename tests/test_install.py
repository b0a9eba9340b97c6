"""`pip install .` without extras gives a working engine, with no Ray, FastAPI, pydantic or Locust.

A throwaway environment, built without the network: `python -m venv --without-pip`, whose site-packages
holds links to every package of this test's own environment except the serving and load stacks (their
modules and their .dist-info, so neither `import` nor importlib.metadata finds them) and except the
editable minserve. This project is then installed into it from a copy of its sources with this
environment's pip and setuptools (`--no-deps --no-index --no-build-isolation`), the way a user installs a
wheel. In a fresh process of that environment, outside the repository: the installed minserve's
Requires-Dist names nothing of the serving stack unconditionally and every unconditional requirement is
installed; `engine` comes from the installed copy, and LLM.generate on the tiny model gives the same
greedy tokens as the repository's engine here.
"""

from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SERVING = ("ray", "fastapi", "pydantic", "pydantic_core", "starlette", "uvicorn", "locust")
SOURCES = ("pyproject.toml", "README.md", "app", "engine", "kernels", "scripts")
PROMPT, MAX_TOKENS = "The quick brown fox", 6


def _dist(entry: str) -> str:
    """The distribution or module a site-packages entry belongs to ("pydantic_core-2.5.dist-info" ->
    "pydantic-core"), normalized as PEP 503 does."""
    return re.sub(r"[-_.]+", "-", entry.split("-")[0].removesuffix(".py")).lower()


def _link_site(dest: Path) -> None:
    """Link every entry of this environment's site-packages into dest, except the serving stack and
    the editable minserve; the first directory that holds a name wins, as on sys.path."""
    skip = {_dist(name) for name in SERVING} | {"minserve"}
    for src_dir in map(Path, site.getsitepackages()):
        for entry in src_dir.iterdir() if src_dir.is_dir() else ():
            if entry.name.startswith("__editable__") or _dist(entry.name) in skip:
                continue
            if not (dest / entry.name).exists():
                (dest / entry.name).symlink_to(entry)


CHECK = """
import importlib.metadata as md, importlib.util, json, sys
from packaging.requirements import Requirement

blocked = {blocked!r}
assert not [m for m in blocked if importlib.util.find_spec(m)], "the serving stack is importable"
reqs = [Requirement(r) for r in md.requires("minserve")]
core = [r for r in reqs if r.marker is None or r.marker.evaluate({{"extra": ""}})]
names = {{r.name.lower() for r in core}}
assert not names & {{"ray", "fastapi", "pydantic", "locust", "starlette"}}, names
missing = [r.name for r in core if not importlib.util.find_spec(r.name) and not md.files(r.name)]
assert not missing, missing
extras = {{e: sorted(r.name for r in reqs if r.marker and r.marker.evaluate({{"extra": e}}) and r not in core)
          for e in md.metadata("minserve").get_all("Provides-Extra")}}

import engine
from engine import LLM, SamplingParams

llm = LLM({model!r})
out = llm.generate({prompt!r}, SamplingParams(max_tokens={max_tokens}, temperature=0.0, ignore_eos=True))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
print(json.dumps({{"engine": engine.__file__, "tokens": out[0].outputs[0].token_ids, "loaded": loaded,
                  "extras": extras, "core": sorted(names)}}))
"""


def test_engine_installs_and_generates_without_the_serving_stack(tmp_path: Path, tiny_model_dir: Path):
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
    python = env_dir / "bin" / "python"
    site_dir = Path(
        subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                text=True).strip()
    )  # fmt: skip
    _link_site(site_dir)
    src = tmp_path / "src"
    for name in SOURCES:  # a copy: building writes build/ and *.egg-info next to the sources
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
           "--no-build-isolation", "--target", str(site_dir), str(src)]  # fmt: skip
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    script = CHECK.format(blocked=SERVING, model=str(tiny_model_dir), prompt=PROMPT, max_tokens=MAX_TOKENS)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([python, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["engine"]).is_relative_to(site_dir)  # the installed copy, not the repository's
    assert got["loaded"] == []
    assert {"ray", "fastapi", "pydantic"} <= set(got["extras"]["serve"])
    assert got["extras"]["load"] == ["locust"]
    assert "torch" in got["core"]

    from engine import LLM, SamplingParams

    want = LLM(str(tiny_model_dir)).generate(
        PROMPT, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    )
    assert got["tokens"] == want[0].outputs[0].token_ids and len(got["tokens"]) == MAX_TOKENS
