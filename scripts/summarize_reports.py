"""Print one closing line over every pytest JUnit report nox wrote to .reports/."""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main() -> int:
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for report in sorted(Path(".reports").glob("*.xml")):
        for suite in ET.parse(report).getroot().iter("testsuite"):
            for key in totals:
                totals[key] += int(suite.get(key, 0))
    failed = totals["failures"] + totals["errors"]
    passed = totals["tests"] - failed - totals["skipped"]
    print(f"yatt: {passed} passed, {failed} failed, {totals['skipped']} skipped")
    return 1 if failed or passed == 0 else 0


if __name__ == "__main__":
    sys.exit(main())
