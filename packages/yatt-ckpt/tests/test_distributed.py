"""2 ranks (gloo, FSDP2-sharded) save; 1 rank loads. A stop signal on one rank stops both."""

NUM_GPUS = 0

import hashlib
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from yatt.ckpt import Checkpointer
from yatt.testing import run_ranks

WORKER = Path(__file__).with_name("_dist_worker.py")


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_two_ranks_save_one_rank_loads(tmp_path, writer):
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    run_ranks([sys.executable, str(WORKER), str(root), str(out), writer], 2, timeout_s=240)

    # Rank 1 alone received SIGUSR1; both ranks must agree to save step 3 and stop, and both
    # report that signal (for one exit code on every rank).
    for rank in range(2):
        decision = json.loads((out / f"rank{rank}.json").read_text())
        deferred = decision.pop("deferred")
        expected = {"is_saved": True, "should_stop": True, "stop_signal": int(signal.SIGUSR1)}
        assert decision == expected, rank
        if writer == "thread":
            # Only rank 1's writer was busy at step 2: both ranks deferred (else rank 0 alone
            # would have entered the save's collectives and hung), then both saved step 3.
            assert deferred == [[True, False], [False, True], [True, False]], rank

    full = torch.load(out / "full.pt")
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: uneven shards
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    with Checkpointer(root) as ckpt:
        assert ckpt.latest() == 3
        info = ckpt.verify(2)  # hashes every file against the checksums the two ranks recorded
        assert info.world_size == 2
        # Both ranks' data files and records carry a checksum (each rank hashed its own).
        files = {p.name for p in info.path.iterdir() if p.name != "yatt_meta.json"}
        assert {"__0_0.distcp", "__1_0.distcp", "rank-00001.json"} <= files
        assert set(info.checksums) == files
        for name in files:
            # Small files: one block, so the rule reduces to sha256(sha256(contents)).
            digest = hashlib.sha256((info.path / name).read_bytes()).digest()
            assert info.checksums[name] == hashlib.sha256(digest).hexdigest(), name
        with pytest.warns(UserWarning, match="written by 2 ranks and is loaded on 1"):
            extra = ckpt.load({"model": model, "optim": optim}, step=2)
        assert extra == {"rank": 0}
        with pytest.warns(UserWarning, match="written by 2 ranks"):
            assert ckpt.load({"model": model, "optim": optim}) == {"rank": 0, "final": True}
    for key, value in full["model"].items():
        assert torch.equal(model.state_dict()[key], value), key
    loaded_optim = optim.state_dict()["state"]
    for index, name in enumerate(full["model"]):
        for field in ("exp_avg", "exp_avg_sq", "step"):
            want = full["optim"]["state"][name][field]
            assert torch.equal(loaded_optim[index][field], want), (name, field)


def test_per_rank_keyed_state_saves_and_loads_on_the_same_ranks(tmp_path):
    worker = Path(__file__).with_name("_rank_keyed_worker.py")
    run_ranks([sys.executable, str(worker), str(tmp_path / "ckpt")], 2)
