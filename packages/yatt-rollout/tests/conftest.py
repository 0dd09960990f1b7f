import time
import traceback
import warnings

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and the test machines share 2 cores: spinning
# OpenMP threads made steps several times slower under load.
torch.set_num_threads(1)

STALL_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from yatt.testing import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("tiny-qwen2")
    make_tiny_causal_lm(path, arch="qwen2", seed=0, max_position_embeddings=512)
    return path


@pytest.fixture
def stall_first_decode():
    """`stall(engine, condition)`: the engine's next loop holds its first decode step until
    `condition()` (so a second call surely arrives while it runs); returns counts from then on:
    "loops" begun, samples "prefilled"."""
    return _stall_first_decode_until


def _stall_first_decode_until(engine, condition) -> dict[str, int]:
    runner = engine._runner
    original, original_begin, original_prefill = (
        runner.run_decode_step,
        runner.begin,
        runner.prefill,
    )
    state = {"waited": False}
    counts = {"loops": 0, "prefilled": 0}

    def begin(*args):
        counts["loops"] += 1
        return original_begin(*args)

    def prefill(items, slots, flags):
        counts["prefilled"] += len(items)
        return original_prefill(items, slots, flags)

    def step(flags, span):
        if not state["waited"]:
            state["waited"] = True
            deadline = time.monotonic() + STALL_TIMEOUT_S
            while not condition():
                assert time.monotonic() < deadline, "the second call never arrived"
                time.sleep(0.005)
        original(flags, span)

    runner.run_decode_step = step
    runner.begin = begin
    runner.prefill = prefill
    return counts


def _assert_same_samples(got, expected, *, atol: float = 1e-4) -> None:
    key = [(c.request_index, c.sample_index, c.request_id) for c in got]
    assert key == [(c.request_index, c.sample_index, c.request_id) for c in expected]
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(
            torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0
        )


@pytest.fixture
def assert_same_samples():
    """Checks two completion lists: same ids, tokens, finish reasons, logprobs within atol."""
    return _assert_same_samples


def _recording_device_syncs(fn, syncs: list[str]):
    """fn, wrapped: each device synchronisation inside it (torch's sync debug mode, CUDA)
    appends the Python stack that reached it, innermost last, to `syncs`."""

    def record(message, category, filename, lineno, *rest):
        if "synchroniz" in str(message):
            syncs.append("".join(traceback.format_stack(limit=10)[:-1]))

    def wrapped(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = record
                return fn(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    return wrapped


@pytest.fixture
def recording_device_syncs():
    """wrap(fn, syncs): fn recording every device synchronisation inside it into syncs."""
    return _recording_device_syncs
