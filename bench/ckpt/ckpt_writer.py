"""Write time of an async save, thread vs process writer, with an idle vs a Python-busy trainer.

    python bench/ckpt/ckpt_writer.py [--gb 2] [--repeats 3] [--device cpu|cuda]
        [--root /dev/shm/yatt-bench-writer]

"write" is the time from save() returning to wait() returning: how long the next save would
block. "busy" runs tiny torch ops (on --device) in a Python loop meanwhile, as a launch-bound
training loop does; a thread writer then waits for the GIL. "blocked" is how long save() itself
took (the staging copy). Prints medians over --repeats saves.
"""

import argparse
import shutil
import statistics
import threading
import time

import torch

from yatt.ckpt import Checkpointer


def keep_python_busy(stop: threading.Event, device: str) -> None:
    x = torch.zeros(16, device=device)
    while not stop.is_set():
        for _ in range(100):
            x = x + 1


def time_writes(root: str, writer: str, state: dict, repeats: int, device: str) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    results: dict[str, list[float]] = {"blocked": [], "idle": [], "busy": []}
    with Checkpointer(root, keep_last=1, writer=writer) as ckpt:
        ckpt.save(0, state)  # warm-up: allocates buffers, starts the writer process
        ckpt.wait()
        step = 1
        for _ in range(repeats):
            for mode in ("idle", "busy"):
                stop = threading.Event()
                busy = threading.Thread(target=keep_python_busy, args=(stop, device))
                start = time.perf_counter()
                ckpt.save(step, state)
                results["blocked"].append(time.perf_counter() - start)
                start = time.perf_counter()
                if mode == "busy":
                    busy.start()
                ckpt.wait()
                results[mode].append(time.perf_counter() - start)
                stop.set()
                if mode == "busy":
                    busy.join()
                step += 1
    shutil.rmtree(root, ignore_errors=True)
    return {mode: statistics.median(times) for mode, times in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--root", default="/dev/shm/yatt-bench-writer")
    args = parser.parse_args()
    torch.manual_seed(0)
    # ~870 tensors, like a 0.5B model's parameters and AdamW moments, scaled to --gb.
    numel = int(args.gb * 2**30 / 4 / 870)
    params = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.randn(numel, device=args.device)) for _ in range(870)]
    )
    state = {"model": params}
    print(
        f"{args.gb:.1f} GB in 870 fp32 tensors on {args.device}; seconds, median of "
        f"{args.repeats}; write = save() returned -> wait() returned"
    )
    print(f"{'writer':>8} {'blocked':>8} {'write idle':>11} {'write busy':>11}")
    for writer in ("thread", "process"):
        times = time_writes(args.root, writer, state, args.repeats, args.device)
        print(
            f"{writer:>8} {times['blocked']:8.2f} {times['idle']:11.2f} {times['busy']:11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
