"""yatt.balance works with numpy alone; only yatt.balance.across_ranks needs torch."""

NUM_GPUS = 0

import subprocess
import sys

BLOCK_TORCH = """
import sys
class BlockTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, BlockTorch())
"""


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH + code], capture_output=True, text=True
    )


def test_core_api_works_without_torch():
    out = run(
        "import yatt.balance as b\n"
        "p = b.partition(b.cost([5, 1, 4, 2], quadratic=0.1), 2, groups=[0, 0, 1, 1])\n"
        "assert sorted(map(sorted, p)) == [[0, 1], [2, 3]], p\n"
        "assert len(b.pack([3, 3, 3], max_tokens=6, multiple_of=2)) == 2\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_across_ranks_needs_torch():
    out = run("import yatt.balance.across_ranks\n")
    assert out.returncode != 0 and "torch is blocked" in out.stderr
