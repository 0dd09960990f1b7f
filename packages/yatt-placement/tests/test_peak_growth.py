"""The memory timeline's peak on a caching allocator: CudaPeakGrowth driven by a fake allocator.

The device's true peak is what the fake allocator held from the driver at its highest (its
reserved bytes) plus what lives outside it; a phase's reported peak (resident at the start +
PeakGrowth.device) must be that, never above the device, while the growth auto plans by
(PeakGrowth.in_use) stays the tensors' own."""

from yatt.placement import FitConfig, PeakGrowth
from yatt.placement._fit import AllocatorStats, CudaPeakGrowth, FitBooks
from yatt.placement._records import PhaseRecord, phase_metrics

GIB = 1 << 30


class FakeAllocator:
    """torch's caching allocator in miniature: freed blocks stay reserved (cached) until
    empty_cache; `outside` is device memory it does not manage (other allocators)."""

    def __init__(self, total: int, outside: int = 0) -> None:
        self.total = total
        self.outside = outside
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.true_peak_used = 0  # the device's highest use since the last reset

    def _note(self) -> None:
        used = self.outside + self.reserved
        assert used <= self.total, "the fake device ran out"
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.true_peak_used = max(self.true_peak_used, used)

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)  # cached blocks first, then the driver
        self._note()

    def free(self, n: int) -> None:
        self.allocated -= n  # stays reserved: cached

    def outside_alloc(self, n: int) -> None:
        self.outside += n
        self._note()

    def read(self) -> AllocatorStats:
        return AllocatorStats(
            allocated=self.allocated,
            reserved=self.reserved,
            peak_allocated=self.peak_allocated,
            peak_reserved=self.peak_reserved,
            device_used=self.outside + self.reserved,
            device_total=self.total,
        )

    def reset(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved
        self.true_peak_used = self.outside + self.reserved


def _window(alloc: FakeAllocator, growth: CudaPeakGrowth, run) -> tuple[int, PeakGrowth]:
    """(device use at the window's start, its growth) around `run()`."""
    growth()  # the switch's end: a new window
    start_used = alloc.outside + alloc.reserved
    run()
    return start_used, growth()


def test_activations_in_cached_blocks_do_not_raise_the_peak_twice():
    # Issue 27's table: a trainer's activations (65 GiB) freed at the end of one train phase
    # stay cached; the next train phase places them in those blocks. The device never holds
    # more than weights + cache (127 GiB of 141), though resident + allocated growth says 192.
    alloc = FakeAllocator(total=141 * GIB)
    growth = CudaPeakGrowth(read=alloc.read, reset=alloc.reset)
    alloc.alloc(62 * GIB)  # the roles' weights, KV caches, optimizer state

    def train():
        alloc.alloc(65 * GIB)
        alloc.free(65 * GIB)

    _window(alloc, growth, train)  # first step: the cache is made
    start, g = _window(alloc, growth, train)
    assert start == 127 * GIB
    assert start + g.device == alloc.true_peak_used == 127 * GIB
    assert g.in_use == 65 * GIB  # what auto plans by: the tensors, not the cache


def test_tensors_beyond_the_cache_and_outside_memory_count_once():
    alloc = FakeAllocator(total=100 * GIB, outside=2 * GIB)
    growth = CudaPeakGrowth(read=alloc.read, reset=alloc.reset)
    alloc.alloc(50 * GIB)
    alloc.free(10 * GIB)  # 10 GiB cached

    def phase():
        alloc.alloc(25 * GIB)  # 10 from the cache, 15 new from the driver
        alloc.outside_alloc(3 * GIB)  # e.g. a communicator's buffers, kept
        alloc.free(25 * GIB)

    start, g = _window(alloc, growth, phase)
    assert start + g.device == alloc.true_peak_used == (2 + 50 + 15 + 3) * GIB
    assert g.in_use == (25 + 3) * GIB


def test_the_peak_never_exceeds_the_device():
    # Outside memory freed during the window lets torch reserve more than was free at the
    # start; adding both edges' readings would pass the device's size.
    alloc = FakeAllocator(total=141 * GIB, outside=30 * GIB)
    growth = CudaPeakGrowth(read=alloc.read, reset=alloc.reset)
    alloc.alloc(100 * GIB)

    def phase():
        alloc.outside -= 20 * GIB  # another allocator gives memory back
        alloc.alloc(25 * GIB)  # more than the 11 GiB free at the start
        alloc.free(25 * GIB)

    start, g = _window(alloc, growth, phase)
    assert start + g.device <= alloc.total
    assert start + g.device >= alloc.true_peak_used  # bounded, never below the truth


def test_the_plan_metrics_peak_is_resident_plus_the_device_rise():
    books = FitBooks(
        FitConfig(
            free_bytes=lambda: 0,
            peak_growth=iter([0, PeakGrowth(in_use=65, device=1)]).__next__,
            headroom_bytes=0,
        ),
        lambda: 0,
    )
    books.start_phase("train")
    books.end_phase()
    assert books.growth_bytes("train") == 65  # what auto plans by
    record = PhaseRecord(
        phase="train", switch_s=0, sleep_s=0, wake_s=0, released_bytes=0, woken_bytes=0,
        resident_bytes=127,
    )  # fmt: skip
    m = phase_metrics(
        "train",
        record,
        1,
        books.growth_bytes("train"),
        latest_device_growth_bytes=books.latest_device_growth_bytes("train"),
    )
    assert m["placement/train/peak_bytes"] == 128.0
    assert m["placement/train/peak_growth_bytes"] == 65.0
