"""The engine table's report: the run JSONs of bench/rollout/engines.py merged into markdown.

    python bench/rollout/engines_report.py $OUT/engines_table_*.json --md bench/results/engines_<gpu>.md

(`python bench/rollout/engines.py --report FILES --md OUT` does the same.) One table per shape:
rows engine x mode, columns each decode batch run, judge prefill and judge total (median (min-max)
tok/s); then built-in / the best vLLM or SGLang row (the bar: >= 1.0 on decode and judge prefill),
each engine's through-yatt / own-API ratio per seeding, and every run's settings and errors.
Reads JSON only: no engine, torch or GPU is imported.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from _engine_shapes import ENGINE_NAMES, SHAPES
from report import write_report as write_files

COLUMNS = ("decode 64", "decode 256", "judge prefill", "judge total")  # the workloads


def columns_of(results: list[dict]) -> tuple[str, ...]:
    """The report's columns: each decode batch a session ran, then the judge's two."""
    batches = sorted({int(b) for r in results for b in r["workload"]["decode"]["batches"]})
    return (*(f"decode {b}" for b in batches), "judge prefill", "judge total")


def cell_value(row: dict, column: str) -> dict | None:
    """A column's summary (tok_s, min_tok_s, max_tok_s) in one mode's results, or None."""
    kind, key = column.split(" ")
    if kind == "decode":
        return row.get("decode", {}).get(key)
    return row.get("judge", {}).get(key)


def table_rows(results: list[dict]) -> dict[str, dict[tuple[str, str], dict]]:
    """shape -> {(engine, mode): that mode's results}, over every JSON of a session."""
    by_shape: dict[str, dict[tuple[str, str], dict]] = {}
    for r in results:
        for mode, row in r.get("results", {}).items():
            by_shape.setdefault(r["shape"], {})[(r["engine"], mode)] = row
    return by_shape


def builtin_ratios(
    rows: dict[tuple[str, str], dict], columns: tuple[str, ...] = COLUMNS
) -> dict[str, tuple[float, str] | None]:
    """Per column: built-in tok/s / the best vLLM or SGLang row's (any mode), and that row."""
    ratios: dict[str, tuple[float, str] | None] = {}
    base = next((row for (engine, _), row in rows.items() if engine == "builtin"), None)
    for column in columns:
        best, best_name = 0.0, ""
        for (engine, mode), row in rows.items():
            value = cell_value(row, column)
            if engine != "builtin" and value and value["tok_s"] > best:
                best, best_name = value["tok_s"], f"{ENGINE_NAMES[engine]} {mode_name(mode)}"
        mine = cell_value(base, column) if base else None
        ratios[column] = (mine["tok_s"] / best, best_name) if mine and best else None
    return ratios


def adapter_ratios(
    rows: dict[tuple[str, str], dict], columns: tuple[str, ...] = COLUMNS
) -> dict[tuple[str, str, str], dict[str, float]]:
    """(engine, seeded|unseeded, native|inproc) -> column -> adapter tok/s / own API's tok/s,
    each adapter mode against the own-API modes of the same seeding."""
    out: dict[tuple[str, str, str], dict[str, float]] = {}
    for (engine, mode), row in rows.items():
        if engine == "builtin" or not mode.startswith("adapter_"):
            continue
        seeding = mode.split("_", 1)[1]
        for way in ("native", "inproc"):
            own = rows.get((engine, f"{way}_{seeding}"))
            for column in columns if own else ():
                a, n = cell_value(row, column), cell_value(own, column)
                if a and n:
                    out.setdefault((engine, seeding, way), {})[column] = a["tok_s"] / n["tok_s"]
    return out


WAYS = {"adapter": "through yatt", "native": "own API", "inproc": "own API, core in-process"}


def mode_name(mode: str) -> str:
    way, seeding = mode.split("_", 1)
    return f"{WAYS[way]}, {seeding}"


def fmt_cell(value: dict | None) -> str:
    if not value:
        return "-"
    return f"{value['tok_s']:,.0f} ({value['min_tok_s']:,.0f}-{value['max_tok_s']:,.0f})"


def build_report(results: list[dict]) -> str:
    """Markdown: one table per shape, the bars' ratios, adapter/native ratios, the settings."""
    if not results:
        raise ValueError("--report: no JSON files given")
    first = results[0]
    devices = sorted({r.get("device", "?") for r in results})
    commits = sorted({r.get("commit", "unknown") for r in results})
    judge = first["workload"]["judge"]
    decode = first["workload"]["decode"]
    lines = [
        f"# Engine table ({', '.join(devices)})",
        "",
        f"commit: {', '.join(commits)}. Random-weight Qwen2.5-shaped models (bf16), temperature "
        f"1, EOS ignored. Decode: {decode['prompt_tokens']}-token prompts, "
        f"{decode['new_tokens']} new tokens, new tok/s. Judge-like load: batch {judge['batch']}, "
        f"{judge['prompt_tokens']}-token prompts, {judge['new_tokens']} new tokens; prefill = "
        "prompt tok/s of the call with 1 new token, total = (prompt + new) tok/s of the full "
        f"call. Median (min-max) of {first['workload']['repeats']} timed calls after a warm-up.",
        "",
    ]
    by_shape = table_rows(results)
    columns = columns_of(results)
    order = {"builtin": 0, "vllm": 1, "sglang": 2}
    for shape in sorted(by_shape, key=lambda s: list(SHAPES).index(s)):
        rows = by_shape[shape]
        lines += [
            f"## {shape.upper()} shape",
            "",
            "| engine | mode | " + " | ".join(f"{c} tok/s" for c in columns) + " |",
            "|---|---|" + "---:|" * len(columns),
        ]
        for engine, mode in sorted(rows, key=lambda k: (order[k[0]], k[1])):
            cells = [fmt_cell(cell_value(rows[(engine, mode)], c)) for c in columns]
            label = "yatt's protocol, seeded" if engine == "builtin" else mode_name(mode)
            lines.append(f"| {ENGINE_NAMES[engine]} | {label} | " + " | ".join(cells) + " |")
        ratios = builtin_ratios(rows, columns)
        cells = [
            f"**{r[0]:.2f}x** vs {r[1]}"
            + (" (bar >= 1.0: met)" if r[0] >= 1.0 else " (bar: NOT met)")
            if r and c != "judge total"
            else (f"{r[0]:.2f}x vs {r[1]}" if r else "-")
            for c, r in ratios.items()
        ]
        lines.append("| built-in / best of vLLM and SGLang | | " + " | ".join(cells) + " |")
        for (engine, seeding, way), cols in sorted(adapter_ratios(rows, columns).items()):
            cells = [f"{cols[c]:.2f}x" if c in cols else "-" for c in columns]
            against = WAYS[way].removeprefix("own API").lstrip(", ")
            lines.append(
                f"| {ENGINE_NAMES[engine]} through yatt / own API"
                f"{f' ({against})' if against else ''} | {seeding} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    lines += [
        "Where the adapter can cost throughput (what the ratios above measure): vLLM through "
        "yatt runs its engine core in-process (weight buckets pass by reference), so the "
        "core's scheduling, model runner and output processing share the caller's process and "
        "GIL, and "
        "it steps `LLMEngine` itself, one request per sample with streamed (DELTA) outputs; "
        "'own API' at vLLM's defaults has the core in its own process with async scheduling, "
        "and 'own API, core in-process' is `LLM.generate` on the adapter's own engine: "
        "adapter / in-process is the adapter's own cost, in-process / own API the core's "
        "placement. SGLang through yatt and SGLang's own `Engine.generate` share one engine "
        "(same server settings): their ratio is the adapter's per-request jobs and output "
        "conversion alone.",
        "",
        "## Runs",
        "",
        "| run | version | startup s | settings | errors |",
        "|---|---|---:|---|---|",
    ]
    for r in results:
        startup = f"{r['startup_s']:.0f}" if "startup_s" in r else "-"
        shown = {
            **r.get("settings", {}),
            **({"resolved": r["resolved"]} if r.get("resolved") else {}),
        }
        settings = json.dumps(shown, sort_keys=True).replace("|", "/")
        errors = "; ".join(f"{k}: {v[:200]}" for k, v in r.get("errors", {}).items()) or ""
        lines.append(
            f"| {r['run']} | {r.get('version', '?')} | {startup} | `{settings}` | {errors} |"
        )
    return "\n".join(lines) + "\n"


def write_report(paths: list[str], md: str) -> str:
    """The report of the run JSONs at `paths` (read in sorted order), written to `md`; returns it."""
    results = [json.loads(Path(p).read_text()) for p in sorted(paths)]
    text = build_report(results)
    write_files(md, text)
    return text


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="run JSONs (engines.py --run ... --out FILE)")
    parser.add_argument("--md", required=True, help="the markdown file to write")
    args = parser.parse_args(argv)
    print(write_report(args.files, args.md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
