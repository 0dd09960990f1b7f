"""The demo on a busy machine: wall time of the README's demo command alone, then beside
CPU-bound processes that keep cores busy (issue 46: within 2x of its idle time on a busy 2-core
machine; torch's default of one thread per core, per process, made it several times slower).

    python bench/train/busy_machine.py                      # idle, 1 busy core, every core busy
    python bench/train/busy_machine.py --steps 40 --repeats 2

Each run is `python examples/train_grpo.py num_steps=N out_dir=...` (the embedded task built
once beforehand, so every run times the same work: loading, N steps, the end-of-run summary).
Runs of one setting are repeated; the report gives the median with min/max, and each busy
setting's median over the idle median. OMP_NUM_THREADS is removed from the runs' environment:
the trainer sizes its own threads, which is what is measured.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "_common"))
from measured_commit import measured_commit  # noqa: E402
from report import write_report  # noqa: E402

TRAINER = ROOT / "examples" / "train_grpo.py"
BAR = 2.0  # busy / idle, the bar
_SPIN = "while True: pass"


def timed_run(command: Sequence[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def with_busy_cores(num_busy: int, run):
    """run() while `num_busy` processes spin, one per core the OS gives them."""
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(num_busy)]
    try:
        return run()
    finally:
        for proc in spinners:
            proc.kill()
            proc.wait()


def summarize(seconds: Sequence[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(seconds),
        "min_s": min(seconds),
        "max_s": max(seconds),
        "runs_s": list(seconds),
    }


def measure(
    command_for, settings: Sequence[tuple[str, int]], repeats: int, env: dict[str, str]
) -> dict[str, dict]:
    """{setting: summary}; each setting's runs alternate with the others' (one of each, then
    again), so a drift in the machine's load falls on every setting alike."""
    times: dict[str, list[float]] = {name: [] for name, _ in settings}
    for repeat in range(repeats):
        for name, num_busy in settings:
            command = command_for(f"{name}-{repeat}")
            seconds = with_busy_cores(num_busy, lambda c=command: timed_run(c, env))
            times[name].append(seconds)
            print(f"{name} run {repeat}: {seconds:.1f} s", flush=True)
    return {name: summarize(values) for name, values in times.items()}


def ratios(results: dict[str, dict], idle: str = "idle") -> dict[str, float]:
    base = results[idle]["median_s"]
    return {name: r["median_s"] / base for name, r in results.items() if name != idle}


def to_markdown(data: dict) -> str:
    lines = [
        "# The demo on a busy machine (issue 46)",
        "",
        f"`python bench/train/busy_machine.py --steps {data['steps']} --repeats "
        f"{data['repeats']}`; commit: {data['commit']}; {data['machine']}, "
        f"{data['num_cpus']} usable CPUs. The README's demo command with num_steps="
        f"{data['steps']} (the embedded task built beforehand), OMP_NUM_THREADS unset (the "
        "trainer sizes its threads); busy = CPU-bound spinning processes beside it.",
        "",
        "| setting | busy processes | median s | min s | max s | median / idle | bar |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, num_busy in data["settings"]:
        r = data["results"][name]
        ratio = data["ratios"].get(name)
        ratio_text = "1.00" if ratio is None else f"{ratio:.2f}"
        bar = "" if ratio is None else f"<= {BAR:.1f} {'met' if ratio <= BAR else 'missed'}"
        lines.append(
            f"| {name} | {num_busy} | {r['median_s']:.1f} | {r['min_s']:.1f} | "
            f"{r['max_s']:.1f} | {ratio_text} | {bar} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--embedded", type=Path, help="a built embedded task (OUT/embedded of an earlier run)"
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "busy_machine_cpu.md"
    )
    args = parser.parse_args(argv)
    num_cpus = len(os.sched_getaffinity(0))
    settings = [("idle", 0), ("one core busy", 1), ("every core busy", num_cpus)]
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        paths = args.embedded
        if paths is None:
            # num_steps=0 builds the embedded task once; the timed runs reuse its models
            build = Path(tmp) / "build"
            subprocess.run(
                [sys.executable, str(TRAINER), f"out_dir={build}", "num_steps=0"],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            paths = build / "embedded"

        def command_for(name: str) -> list[str]:
            return [
                sys.executable,
                str(TRAINER),
                "task=text",
                f"policy.model_dir={paths / 'policy'}",
                f"data.path={paths / 'prompts.jsonl'}",
                f"reward.judge_dir={paths / 'judge'}",
                f"num_steps={args.steps}",
                f"out_dir={Path(tmp) / name.replace(' ', '_')}",
            ]

        results = measure(command_for, settings, args.repeats, env)
    data = {
        "commit": measured_commit(["examples", "packages"]),
        "machine": platform.processor() or platform.machine(),
        "num_cpus": num_cpus,
        "steps": args.steps,
        "repeats": args.repeats,
        "settings": settings,
        "results": results,
        "ratios": ratios(results),
    }
    print(write_report(args.out, to_markdown(data), data=data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
