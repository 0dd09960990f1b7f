"""run_rank_script: a script in a string run as N ranks, each rank's `RESULT <json>` value back
in rank order; a rank that prints no result, or two, fails with its output."""

NUM_GPUS = 0

import pytest

from yatt.testing import run_rank_script

_ECHO = """
    import json, os, sys
    print("noise before")
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "args": sys.argv[1:]}))
"""


def test_each_ranks_json_result_comes_back_in_rank_order(tmp_path):
    results = run_rank_script(_ECHO, 3, tmp_path, args=["x"], timeout_s=60)
    assert results == [{"rank": r, "args": ["x"]} for r in range(3)]


def test_a_rank_without_one_result_line_fails_with_its_output(tmp_path):
    source = """
        import os
        if os.environ["RANK"] == "1":
            print("RESULT 1")
            print("RESULT 2")
    """
    with pytest.raises(AssertionError, match=r"rank 0 printed 0 result lines"):
        run_rank_script(source, 2, tmp_path, timeout_s=60)
