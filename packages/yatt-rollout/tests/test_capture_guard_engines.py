"""Two built-in engines generating in two threads, as a rollout and a judge do under partial
colocation: one engine's CUDA-graph captures never overlap the other's compiled calls (a first
compiled call autotunes with device synchronisations, which invalidated a judge's capture on an
H200 at 16ea75f), and neither thread waits forever on the other.

On CPU there are no graphs: the capture is stood in for by a hold of yatt.placement's
capturing() at each loop's begin (where the engine captures), and torch.compile by a
pass-through that records which thread held what when it ran."""

from __future__ import annotations

import threading
import time

from yatt.placement import _capture_guard, capturing
from yatt.rollout import Request, SamplingParams
from yatt.rollout.builtin import BuiltinEngine, EngineConfig

CALLS_PER_ENGINE = 4
JOIN_S = 120.0


def test_captures_and_compiled_calls_of_two_engine_threads_never_overlap(
    tiny_model_dir, monkeypatch
):
    import yatt.rollout.builtin._batcher as batcher

    overlaps: list[str] = []
    counts = {"compiled": 0, "captures": 0}
    lock = threading.Lock()

    def pass_through_compile(fn, **kwargs):
        def compiled(*args, **kw):
            me = threading.get_ident()
            capturer = _capture_guard._GUARD._capturer
            with lock:
                counts["compiled"] += 1
                if capturer not in (None, me):
                    overlaps.append("a compiled call ran during another thread's capture")
                if me not in _capture_guard._GUARD._open and capturer != me:
                    overlaps.append("a compiled call ran outside may_sync")
            time.sleep(0.002)  # widen the window a real compile would hold
            return fn(*args, **kw)

        return compiled

    original_begin = batcher.SlotRunner.begin

    def begin_with_capture(self, sampling, stop_ids):
        flags = original_begin(self, sampling, stop_ids)
        with capturing():  # where _capture_all holds it on CUDA
            with lock:
                counts["captures"] += 1
            time.sleep(0.01)
        return flags

    monkeypatch.setattr(batcher.torch, "compile", pass_through_compile)
    monkeypatch.setattr(batcher.SlotRunner, "begin", begin_with_capture)
    engines = [
        BuiltinEngine(
            tiny_model_dir,
            config=EngineConfig(
                max_batch_size=3,
                max_seq_len=96,
                compile_decode=True,
                compile_prefill=True,
                region_prefix=f"guard{i}",
            ),
        )
        for i in range(2)
    ]
    errors: list[BaseException] = []

    def drive(engine: BuiltinEngine, seed: int) -> None:
        try:
            for call in range(CALLS_PER_ENGINE):
                requests = [Request(prompt_ids=[5 + call, 9, 11 + i]) for i in range(4)]
                sampling = SamplingParams(n=2, max_new_tokens=6, ignore_eos=True, seed=seed + call)
                engine.generate(requests, sampling)
        except BaseException as exc:  # reported below; a thread's exception is otherwise lost
            errors.append(exc)

    threads = [
        threading.Thread(target=drive, args=(engine, 10 * i), daemon=True)
        for i, engine in enumerate(engines)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_S)
    hung = [thread for thread in threads if thread.is_alive()]
    for engine in engines if not hung else ():
        engine.close()
    assert not hung, "an engine thread waited forever (capture guard deadlock)"
    assert not errors, errors
    assert counts["captures"] == 2 * CALLS_PER_ENGINE
    assert counts["compiled"] > 0
    assert not overlaps, overlaps[:3]
