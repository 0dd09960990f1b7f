"""bench/train/train_step_profile.py on the CPU: its comparison plans, worked by hand, and its
refusal to time a CPU unless asked for a smoke run."""

NUM_GPUS = 0

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "train"))
import train_step_profile as profile


def test_sorted_plan_fills_each_micro_batch_to_the_cap():
    # Longest first: 10 (row 0), 9 (row 3), 3 (row 1), 3 (row 2). Cap 20: {10, 9} pads to
    # 2 x 10 = 20; adding a 3 would pad 3 x 10 = 30; the 3s start a part: 2 x 3 = 6.
    lengths = [10, 3, 3, 9]
    plan = profile.plan_sorted(lengths, 20)
    assert plan == [[0, 3], [1, 2]]
    assert profile.padded_tokens(plan, lengths) == 2 * 10 + 2 * 3


def test_cap_only_plan_keeps_each_part_under_the_cap_and_every_row_once():
    lengths = [1000, 200, 200, 200, 900, 200, 200, 200]
    plan = profile.plan_cap_only(lengths, [float(n) for n in lengths], 2400)
    assert sorted(i for part in plan for i in part) == list(range(len(lengths)))
    for part in plan:
        assert len(part) == 1 or len(part) * max(lengths[i] for i in part) <= 2400


def test_batches_hold_the_prompt_then_the_response_in_the_loss_mask():
    batch = profile.make_batch([3, 5], seed=0, vocab=50)
    assert batch.lengths.tolist() == [profile.PROMPT_TOKENS + 3, profile.PROMPT_TOKENS + 5]
    assert batch["loss_mask"].sum(dim=1).tolist() == [3, 5]
    assert int(batch["input_ids"].max()) < 50


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_without_cuda_it_asks_for_the_smoke_flag():
    script = ROOT / "bench" / "train" / "train_step_profile.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert out.returncode != 0 and "--tiny" in out.stderr
