"""Every command shown in README.md and docs/*.md passes a smoke check, and every report they name exists.

How a command is checked (tests/docs_commands.py finds them), without running it:
- `python -m MODULE ARGS`: MODULE's own argparse parser accepts ARGS, in one child process that stops
  each program right after parsing; a module without argparse must at least exist;
- `minserve ARGS` (the console script of app/cli.py): as `python -m app.cli ARGS`;
- `python -m pytest ARGS`: each marker named by `-m` is registered and each path exists;
- `make TARGET...`: `make -n TARGET...` succeeds;
- `serve run|deploy CONFIG`: the YAML parses and its application builds as `serve run` builds it;
- `locust -f PATH ...`: `locust -f PATH --help` succeeds and lists every option the command uses;
- `path/to/script.sh`: it exists, is executable, and `bash -n` parses it.
What needs a running server or cluster is named in NOT_RUNNABLE with the reason. Any other command
fails the test: a new kind of command needs a check here or a reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.docs_commands import ROOT, Shown, doc_paths, shown_commands, tokens

NOT_RUNNABLE = [
    (re.compile(r"^curl\b"), "talks to a running server"),
    (re.compile(r"^prometheus\b"), "an external binary, reading a running Ray session's files"),
    (re.compile(r"^ray (start|get-auth-token)\b"), "starts, or asks, a Ray cluster node"),
]
CHILD_TIMEOUT_S = 240


def all_shown() -> list[Shown]:
    return [c for p in doc_paths() for c in shown_commands(str(p.relative_to(ROOT)), p.read_text())]


def plan(shown: Shown) -> tuple[str, object]:
    """(kind, what to check) for one command; kind "unknown" fails the test."""
    words = tokens(shown.text)
    line = " ".join(words)
    for pattern, reason in NOT_RUNNABLE:
        if pattern.match(line):
            return "not runnable", reason
    if words[:3] == ["python", "-m", "pytest"]:
        return "pytest", words[3:]
    if words[:2] == ["python", "-m"] and len(words) > 2:
        return "module", {"module": words[2], "argv": words[3:]}
    if words[0] == "minserve" and len(words) > 1:
        return "module", {"module": "app.cli", "argv": words[1:]}
    if words[0] == "make" and len(words) > 1:
        return "make", words[1:]
    if words[0] == "serve" and words[1:2] in (["run"], ["deploy"]) and len(words) > 2:
        return "serve", {"config": words[2]}
    if words[0] == "locust" and "-f" in words:
        return "locust", words
    if words[0].endswith(".sh"):
        return "script", words[0]
    return "unknown", "no check and no reason in NOT_RUNNABLE"


def run_child(jobs: list[dict]) -> list[str]:
    """tests/docs_commands.py as a child process: one answer per job ("" = passed)."""
    child = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs_commands.py")],
        input=json.dumps(jobs),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=CHILD_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in child.stdout.splitlines() if line.startswith("ANSWERS ")]
    assert lines, f"the child printed no answers (rc {child.returncode}): {child.stderr[-2000:]}"
    return json.loads(lines[-1].removeprefix("ANSWERS "))


def check_pytest(argv: list[str], markers: set[str]) -> str:
    """Each marker of `-m` is registered (or a boolean operator) and each path exists."""
    known = markers | {"not", "and", "or"}
    problems = []
    for i, word in enumerate(argv):
        if i and argv[i - 1] == "-m":
            problems += [f"unknown marker {w}" for w in re.findall(r"\w+", word) if w not in known]
        elif not word.startswith("-") and not (ROOT / word.split("::")[0]).exists():
            problems.append(f"no path {word}")
    return "; ".join(problems)


def check_subprocess(kind: str, payload) -> str:
    """make, locust and shell scripts: each its own short subprocess."""
    if kind == "make":
        done = subprocess.run(["make", "-n", *payload], cwd=ROOT, capture_output=True, text=True)
        return "" if done.returncode == 0 else done.stderr.strip()[-400:]
    if kind == "locust":
        return check_locust(payload)
    path = ROOT / payload
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"{payload} is not an executable file"
    done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    return done.stderr.strip()


def check_locust(words: list[str]) -> str:
    """`locust -f PATH --help` runs, PATH's files compile, and each option is Locust's or PATH's own."""
    path = ROOT / words[words.index("-f") + 1]
    files = sorted(path.glob("*.py")) if path.is_dir() else [path]
    if not files:
        return f"no locustfile at {path}"
    source = "".join(f.read_text() for f in files)
    for f in files:
        compile(f.read_text(), str(f), "exec")
    locust = ROOT / ".venv" / "bin" / "locust"
    exe = str(locust) if locust.exists() else "locust"
    done = subprocess.run([exe, "-f", str(path), "--help"], cwd=ROOT, capture_output=True, text=True)
    options = [w.split("=")[0] for w in words if w.startswith("--")]
    missing = [o for o in options if o not in done.stdout and f'"{o}"' not in source]
    return f"rc {done.returncode}; unknown options {missing}" if done.returncode or missing else ""


def check_all(shown: list[Shown], markers: set[str]) -> list[str]:
    """One failure line per command that fails its check (or has none)."""
    plans = [(s, *plan(s)) for s in shown]
    failures = [f"{s.where}: {s.text}: {why}" for s, kind, why in plans if kind == "unknown"]
    for s, kind, arg in plans:
        if kind == "pytest" and (why := check_pytest(arg, markers)):
            failures.append(f"{s.where}: {s.text}: {why}")
    child = [(s, arg) for s, kind, arg in plans if kind in ("module", "serve")]
    local = [(s, kind, arg) for s, kind, arg in plans if kind in ("make", "locust", "script")]
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = pool.submit(run_child, [arg for _, arg in child]) if child else None
        local_answers = list(pool.map(lambda item: check_subprocess(item[1], item[2]), local))
        child_answers = answers.result() if answers else []
    failures += [f"{s.where}: {s.text}: {why}" for (s, _), why in zip(child, child_answers) if why]
    failures += [f"{s.where}: {s.text}: {why}" for (s, _, _), why in zip(local, local_answers) if why]
    return failures


def registered_markers(pytestconfig) -> set[str]:
    return {line.split(":")[0].strip() for line in pytestconfig.getini("markers")}


def test_every_command_shown_in_the_docs_passes_its_smoke_check(pytestconfig):
    shown = all_shown()
    kinds = {plan(s)[0] for s in shown}
    assert {"module", "make", "serve", "pytest"} <= kinds, f"the extraction found too little: {kinds}"
    failures = check_all(shown, registered_markers(pytestconfig))
    assert not failures, "commands in the docs that fail their check:\n" + "\n".join(failures)


def test_a_missing_module_a_bad_argument_and_an_unknown_command_fail(pytestconfig):
    doc = (
        "```bash\npython -m benchmarks.no_such_bench --out /tmp/x\n"
        "python -m benchmarks.spec_bench --proposers ngram\nfrobnicate --now\n```\n"
        "Inline: `python -m benchmarks.core_transport --out /tmp/ct` and `make no-such-target`.\n"
    )
    shown = shown_commands("planted.md", doc)
    assert [s.text for s in shown][-2:] == [
        "python -m benchmarks.core_transport --out /tmp/ct",
        "make no-such-target",
    ]
    failures = check_all(shown, registered_markers(pytestconfig))
    failed = {line.split(": ")[1] for line in failures}
    assert failed == {
        "python -m benchmarks.no_such_bench --out /tmp/x",
        "python -m benchmarks.spec_bench --proposers ngram",  # --out is required
        "frobnicate --now",
        "make no-such-target",
    }, failures


REPORTS = ROOT / "benchmarks" / "reports"
REPORT_NAME = re.compile(
    r"[\w.-]+_(?:h100|h200|h200x2|cpu)[\w-]*\.(?:md|json|log)|benchmark\.(?:md|json|png)"
)


def test_every_report_the_docs_name_exists():
    """Paths under benchmarks/reports/ and bare report file names in README.md and docs/*.md."""
    present = {p.name for p in REPORTS.rglob("*") if p.is_file()}
    missing = []
    for doc in doc_paths():
        text = doc.read_text()
        for path in re.findall(r"benchmarks/reports/[\w./*<>-]*[\w>]", text):
            # a path, a glob, or a benchmark's --out prefix (PREFIX.json, PREFIX.md)
            if not any(ROOT.glob(re.sub(r"<\w+>", "*", path).rstrip("*") + "*")):
                missing.append(f"{doc.name}: {path}")
        missing += [f"{doc.name}: {name}" for name in REPORT_NAME.findall(text) if name not in present]
    assert not missing, missing


def listed(path: Path, index: str) -> bool:
    """The index names the file by its stem, or names its per-call folder (not `gpu/` itself)."""
    folder = path.parent.relative_to(REPORTS)
    return path.stem in index or (str(folder) not in (".", "gpu") and f"{folder.name}/" in index)


def test_the_reports_index_lists_every_report():
    """benchmarks/reports/README.md names each report file or the per-call folder it sits in."""
    index = (REPORTS / "README.md").read_text()
    files = [p for p in REPORTS.rglob("*") if p.is_file() and p.name != "README.md"]
    unlisted = [str(p.relative_to(REPORTS)) for p in files if not listed(p, index)]
    assert not unlisted, unlisted
