"""bench/train/busy_machine.py's own logic, on a trivial command: settings alternate, busy
processes are started and gone after each run, and the ratio is each median over idle's."""

NUM_GPUS = 0

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "train"))

import busy_machine


def _children_spinning() -> int:
    """This process's children running the spinner (another run's spinners on the same machine
    are not ours to count)."""
    count = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split
            # after its closing parenthesis.
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid != os.getpid():
                continue
            if busy_machine._SPIN in (proc / "cmdline").read_bytes().decode(errors="replace"):
                count += 1
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return count


def test_settings_alternate_and_spinners_are_gone_after_each_run(tmp_path):
    seen = []

    def command_for(name):
        seen.append(name)
        return [sys.executable, "-c", "pass"]

    settings = [("idle", 0), ("busy", 1)]
    results = busy_machine.measure(command_for, settings, repeats=2, env=dict(os.environ))
    assert seen == ["idle-0", "busy-0", "idle-1", "busy-1"]
    assert _children_spinning() == 0
    for summary in results.values():
        assert len(summary["runs_s"]) == 2
        assert summary["min_s"] <= summary["median_s"] <= summary["max_s"]


def test_ratio_is_each_median_over_the_idle_median_and_the_report_names_the_bar():
    results = {
        "idle": busy_machine.summarize([10.0, 12.0, 30.0]),  # median 12
        "busy": busy_machine.summarize([18.0, 30.0, 36.0]),  # median 30
    }
    ratios = busy_machine.ratios(results)
    assert ratios == {"busy": 2.5}
    data = {
        "commit": "abc",
        "machine": "x86_64",
        "num_cpus": 2,
        "steps": 3,
        "repeats": 3,
        "settings": [("idle", 0), ("busy", 2)],
        "results": results,
        "ratios": ratios,
    }
    text = busy_machine.to_markdown(data)
    assert "| busy | 2 | 30.0 | 18.0 | 36.0 | 2.50 | <= 2.0 missed |" in text
    assert "| idle | 0 | 12.0 | 10.0 | 30.0 | 1.00 |  |" in text
