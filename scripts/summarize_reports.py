"""Print, over every pytest JUnit report nox wrote to .reports/, where CI's time went (each
session's pytest seconds, the slowest test modules across sessions) and one closing line."""

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

NUM_SLOWEST = 10


def module_seconds(report: Path) -> Counter:
    """Seconds per test module (a test class counts as its own row) in one report: the sum of
    its test cases' times, which pytest's JUnit writer takes over setup, call and teardown."""
    seconds: Counter = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds[case.get("classname", "")] += float(case.get("time", 0))
    return seconds


def main(folder: Path = Path(".reports")) -> int:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    sessions: dict[str, float] = {}
    slowest: Counter = Counter()
    for report in sorted(folder.glob("*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
            sessions[report.stem] = sessions.get(report.stem, 0.0) + float(suite.get("time", 0))
        for module, seconds in module_seconds(report).items():
            slowest[f"{report.stem}: {module}"] += seconds
    if sessions:
        by_time = sorted(sessions.items(), key=lambda item: -item[1])
        print("pytest seconds: " + ", ".join(f"{name} {s:.0f}" for name, s in by_time), end="")
        print(f"; total {sum(sessions.values()):.0f}")
        for name, seconds in slowest.most_common(NUM_SLOWEST):
            print(f"  {seconds:7.1f} s  {name}")
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"yatt: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
