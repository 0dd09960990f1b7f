"""scripts/summarize_reports.py (CI's last step) on hand-built JUnit reports: each session's
pytest seconds, the slowest modules across sessions, the closing line and its exit code."""

NUM_GPUS = 0

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "summarize_reports", ROOT / "scripts" / "summarize_reports.py"
)
summarize_reports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summarize_reports)


def _report(path: Path, suite_time: float, cases: list[tuple[str, float]], **counts) -> None:
    """A pytest-style JUnit file: one suite, its cases as (classname, seconds)."""
    attrs = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0, **counts}
    head = " ".join(f'{k}="{v}"' for k, v in attrs.items())
    body = "".join(
        f'<testcase classname="{c}" name="t{i}" time="{s}"/>' for i, (c, s) in enumerate(cases)
    )
    path.write_text(f'<testsuites><testsuite name="pytest" {head} time="{suite_time}">{body}</testsuite></testsuites>')  # fmt: skip


def test_sessions_and_slowest_modules_are_listed_by_time(tmp_path, capsys):
    _report(tmp_path / "integration.xml", 30.0, [("tests.test_a", 4.0), ("tests.test_b", 20.0), ("tests.test_a", 6.0)])  # fmt: skip
    _report(tmp_path / "yatt-core.xml", 12.4, [("packages.yatt-core.tests.test_c", 12.4)])
    assert summarize_reports.main(tmp_path) == 0
    lines = capsys.readouterr().out.splitlines()
    # sessions by their suite time, largest first; modules summed over their cases (4 + 6)
    assert lines[0] == "pytest seconds: integration 30, yatt-core 12; total 42"
    assert [line.split("s  ", 1)[1] for line in lines[1:4]] == [
        "integration: tests.test_b",
        "yatt-core: packages.yatt-core.tests.test_c",
        "integration: tests.test_a",
    ]
    assert lines[3].split()[0] == "10.0"
    assert lines[-1] == "yatt: 4 passed, 0 failed, 0 skipped"


def test_a_failure_or_no_test_at_all_is_a_non_zero_exit(tmp_path, capsys):
    assert summarize_reports.main(tmp_path) == 1  # no report: nothing passed
    assert capsys.readouterr().out == "yatt: 0 passed, 0 failed, 0 skipped\n"
    _report(tmp_path / "yatt-ckpt.xml", 2.0, [("m", 1.0), ("m", 1.0)], failures=1, skipped=0)
    assert summarize_reports.main(tmp_path) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "yatt: 1 passed, 1 failed, 0 skipped"
