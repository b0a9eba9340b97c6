"""Before/after tables: the same measurements of the baseline tree ("old") and this tree ("new") side by
side, with new / old for each headline figure (`--baseline-tree` of serve_overhead and bench).

`side_by_side(old, new, metrics)` is the merge: two dicts {key: {metric: value}} in, one row per key
(new's keys in order, then keys only old has) with {metric: {"old", "new", "ratio"}}; ratio = new / old
where both are numbers and old is not 0, else None. A ratio above 1 is better for throughput and worse
for TTFT.
"""

from __future__ import annotations

import math

# serve_overhead's headline figures: (field, column label, digits, getter of one run)
SERVE_METRICS = (
    ("out_tok_s", "out tok/s", 0, lambda r: _get(r, "summary", "output_tok_s")),
    ("ttft_p50_ms", "TTFT p50 ms", 1, lambda r: _get(r, "summary", "ttft_ms", "p50")),
    ("ttft_p99_ms", "TTFT p99 ms", 1, lambda r: _get(r, "summary", "ttft_ms", "p99")),
    ("gpu_busy_trace", "GPU busy (trace)", 3, lambda r: _get(r, "gpu_busy", "trace", "busy_fraction")),
    ("gpu_sm_dmon", "SM % (dmon mean)", 1, lambda r: _get(r, "gpu_busy", "dmon", "sm_mean")),
)
SERVE_KEY = ("variant", "stack", "users")
BENCH_KEY = ("figure", "system", "model", "metric")


def _get(d: dict | None, *path: str):
    for key in path:
        d = d.get(key) if isinstance(d, dict) else None
    return d


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not math.isnan(x)


def ratio(new, old) -> float | None:
    return new / old if _number(new) and _number(old) and old != 0 else None


def side_by_side(old: dict, new: dict, metrics: tuple[str, ...]) -> list[dict]:
    """One row per key of `new` (in order), then per key only `old` has:
    {"key", metric: {"old", "new", "ratio"}}."""
    rows = []
    for key in [*new, *(k for k in old if k not in new)]:
        o, n = old.get(key) or {}, new.get(key) or {}
        row: dict = {"key": key}
        for m in metrics:
            row[m] = {"old": o.get(m), "new": n.get(m), "ratio": ratio(n.get(m), o.get(m))}
        rows.append(row)
    return rows


def serve_figures(runs: list[dict], tree: str) -> dict:
    """{(variant, stack, users): {field: value}} of serve_overhead's runs of one tree (no tree = "new")."""
    return {tuple(r[k] for k in SERVE_KEY): {m: get(r) for m, _, _, get in SERVE_METRICS}
            for r in runs if r.get("tree", "new") == tree}  # fmt: skip


def serve_ab(runs: list[dict]) -> list[dict]:
    """serve_overhead's before/after rows (JSON-ready: the key as a dict)."""
    metrics = tuple(m for m, *_ in SERVE_METRICS)
    rows = side_by_side(serve_figures(runs, "old"), serve_figures(runs, "new"), metrics)
    return [{**row, "key": dict(zip(SERVE_KEY, row["key"], strict=True))} for row in rows]


def bench_figures(data: dict) -> dict:
    """{(figure, system, model, metric): {"tok_s", "pct_of_roofline"}} of a benchmarks.report collect()."""
    figures = {}
    for r in data.get("rows", []):
        figures[tuple(r.get(k) or "" for k in BENCH_KEY)] = {
            "tok_s": r["value"],
            "pct_of_roofline": r["pct_of_roofline"],
        }
    return figures


def bench_ab(old: dict, new: dict) -> list[dict]:
    """bench's before/after rows from two report.collect() results."""
    rows = side_by_side(bench_figures(old), bench_figures(new), ("tok_s", "pct_of_roofline"))
    return [{**row, "key": dict(zip(BENCH_KEY, row["key"], strict=True))} for row in rows]


def _cell(x, digits: int) -> str:
    return f"{x:,.{digits}f}" if _number(x) else "-"


def ab_table(rows: list[dict], key: tuple[str, ...], metrics: tuple[tuple[str, str, int], ...]) -> list[str]:
    """Markdown: the key's columns, then old | new | new/old per (field, label, digits)."""
    head = [*key] + [f"{label} {side}" for _, label, _ in metrics for side in ("old", "new", "new/old")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["key"][k]) for k in key]
        for m, _, digits in metrics:
            v = row[m]
            cells += [_cell(v["old"], digits), _cell(v["new"], digits), _cell(v["ratio"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def trees_line(trees: list[dict]) -> str:
    """Which code each side ran, and in what order."""
    sides = [
        f"{t['name']}: {t['root']} (commit {t.get('commit') or 'unknown: not a git work tree'})"
        for t in trees
    ]
    return "- " + "; ".join(sides)


def serve_ab_markdown(report: dict) -> list[str]:
    """serve_overhead's before/after section (empty without a baseline tree)."""
    if not report.get("baseline"):
        return []
    metrics = tuple((m, label, digits) for m, label, digits, _ in SERVE_METRICS)
    return ["", "### Before / after (same host, same invocation)", "", trees_line(report["trees"]),
            "- order: per measurement, old then new (each offline count, each served server, each null "
            "server); ratios are new / old (above 1: more throughput, but longer TTFT)", "",
            *ab_table(report["baseline"], SERVE_KEY, metrics)]  # fmt: skip


def bench_ab_markdown(rows: list[dict], trees: list[dict]) -> str:
    """bench's before/after section: the whole old run first, then the new one."""
    metrics = (("tok_s", "tok/s", 1), ("pct_of_roofline", "% of roofline", 1))
    return "\n".join(["## Before / after (same host, same invocation)", "", trees_line(trees),
                      "- order: the old tree's whole `benchmarks.bench` run first, then the new one; "
                      "ratios are new / old", "", *ab_table(rows, BENCH_KEY, metrics), ""])  # fmt: skip
