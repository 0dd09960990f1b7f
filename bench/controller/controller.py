"""Per-rank controllers (yatt) against a single controller, with multimodal prompts, on CPU.

    python bench/controller/controller.py                      # 1, 2 and 4 ranks; ~1-2 minutes on 2 cores
    python bench/controller/controller.py --ranks 1 2 4 8 --prompts-per-rank 32 --steps 3
    python bench/controller/controller.py --full-step          # the whole GRPO step with a tiny VLM (CPU)
    python bench/controller/controller.py --full-step --device cuda --ranks 1 2    # on 2 GPUs

--full-step measures the same claim with training in the loop (bench/controller/_controller_step.py says
what each mode does): rollout on the built-in engine with the images, a judge, balancing and a
TorchPolicy train step on a tiny Qwen2-VL, per-rank controllers (yatt-step) against rank 0 as
the driver of a single-controller framework (driver-step). On CPU its results go into a section
of controller_cpu.md/.json (the section above stays); with --device cuda into
controller_<gpu>x<ranks>.md/.json, with the peak GPU memory of every rank as well.

Without --full-step (payload only, no model): every prompt carries a 3x448x448 uint8 image
(588 KiB), stored as an .npy file that the dataset row points to, as LLaVA-style JSONL
datasets do. One step, per mode:

    yatt          every rank: ShardedLoader reads its own rows -> decodes its own images
                  -> processes them -> all-reduces scalar stats
    yatt+balance  as yatt, plus Batch.rebalance by length before processing (yatt.balance.across_ranks
                  moves the samples its plan moves, images included, point-to-point)
    baseline      rank 0 (the "driver"): reads every rank's rows -> decodes every image
                  -> scatter_object_list to the ranks (pickled, as a Ray driver ships objects)
                  every rank: processes its share -> gather_object of stats to rank 0

Measured in each process: peak RSS during the steps above its RSS just before them (VmHWM after
clear_refs; imports and the process group are excluded), and the step time (max over ranks).
Workers run with MALLOC_MMAP_THRESHOLD_ fixed at 64 KiB: glibc otherwise raises the threshold
after the first freed image and keeps later images on its heap after they are freed, so RSS
would track the allocator's history instead of the live payloads. The busiest process is the
one with the largest peak. The bar: yatt's busiest-process peak stays flat as ranks grow (slope
under a quarter of one rank's payload per added rank) while the baseline's grows linearly (at
least one rank's payload per added rank). yatt+balance is reported, not judged: what it adds
is what the balancing plan moves, bounded by about two batches (received + send buffer).
Writes bench/results/controller_cpu.json and controller_cpu.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _controller_step import IMAGE_SIZE as IMAGE_SIZE_STEP
from _controller_step import (
    STEP_MODES,
    busiest_process,
    make_shape_dataset,
    make_vlm,
    measure_payload_mib,
    reset_peak_rss,
    rss_kib,
    summarize_launch,
)
from _controller_step import run_worker as run_step_worker

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_common"))
from measured_commit import measured_commit
from report import write_report

IMAGE_SHAPE = (3, 448, 448)
RESULTS = Path(__file__).resolve().parents[1] / "results"  # bench/results
MODES = ("yatt", "yatt+balance", "baseline")
FULL_STEP_KEY = "full_step"  # controller_cpu.json's key for the --full-step results
FULL_STEP_HEADING = "## Full step with a vision-language model"  # and its controller_cpu.md section


def _make_dataset(root: Path, num_rows: int, num_images: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(num_images):
        np.save(root / f"img{i}.npy", rng.integers(0, 256, IMAGE_SHAPE, dtype=np.uint8))
    path = root / "prompts.jsonl"
    with open(path, "w") as f:
        for i in range(num_rows):
            image = str(root / f"img{i % num_images}.npy")
            f.write(json.dumps({"prompt": f"Describe image {i}.", "image": image}) + "\n")
    return path


def _decode(row: dict) -> dict:
    """A sample: its image (a fresh array per row, as a decoder produces) and token ids."""
    import torch

    image = np.load(row["image"])
    length = 64 + (row["_index"] * 37) % 448  # prompt + response tokens, varied
    return {"input_ids": torch.arange(length) % 200, "image": image, "row": row["_index"]}


def _process(samples: list[dict]) -> float:
    """Stand-in for per-sample work on the payload: normalise each image, one at a time."""
    import torch

    total = 0.0
    for sample in samples:
        total += float(torch.from_numpy(sample["image"]).float().div_(255.0).mean())
    return total


def worker(mode: str, data: str, prompts_per_rank: int, steps: int, out: str) -> None:
    import torch.distributed as dist

    from yatt.core import Batch, ShardedLoader, init_runtime, reduce_metrics

    with init_runtime(device="cpu") as rt:
        rank, world = rt.dp_rank, rt.dp_size
        group = rt.dp_group
        if mode != "baseline":
            loader = ShardedLoader(
                data,
                batch_size=prompts_per_rank,
                rank=rank,
                world_size=world,
                image_key="image",
                should_open_images=False,  # .npy files, decoded by _decode
            )
        elif rank == 0:
            loader = ShardedLoader(
                data,
                batch_size=prompts_per_rank * world,
                image_key="image",
                should_open_images=False,
            )
        # Import what the steps import lazily, so the peak counts data, not code.
        import yatt.balance.across_ranks  # noqa: F401

        reduce_metrics({"warm": 0.0}, group=group)
        dist.barrier()
        start_rss = rss_kib("VmRSS")
        reset_peak_rss()
        times = []
        moved_in: list[int] = []  # samples balancing brought to this rank, per step
        for _ in range(steps):
            t0 = time.perf_counter()
            if mode != "baseline":
                samples = [_decode(row) for row in loader.next_batch()]
                batch = Batch.from_samples(samples)
                if mode == "yatt+balance":
                    own = set(batch["row"].tolist())
                    # Images (numpy) ride in meta; only the samples the plan moves travel.
                    batch, _ = batch.rebalance(group=group)
                    moved_in.append(sum(r not in own for r in batch["row"].tolist()))
                score = _process(batch.to_samples())
                reduce_metrics({"score": score}, group=group, default_op="sum")
                del samples, batch
            else:
                chunks = None
                if rank == 0:
                    samples = [_decode(row) for row in loader.next_batch()]
                    chunks = [samples[r::world] for r in range(world)]
                received = [None]
                dist.scatter_object_list(received, chunks, src=0, group=group)
                del chunks
                samples = None
                score = _process(received[0])
                gathered = [None] * world if rank == 0 else None
                dist.gather_object(score, gathered, dst=0, group=group)
                del received
            dist.barrier()
            times.append(time.perf_counter() - t0)
        peak = rss_kib("VmHWM")
        result = {
            "rank": rank,
            "peak_above_start_mib": (peak - start_rss) / 1024,
            "times": times,
            "moved_in": moved_in,
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def launch(mode: str, world: int, data: Path, args: argparse.Namespace) -> dict:
    from yatt.testing import run_ranks  # here: the workers need not import it

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", mode, str(data), out]
        cmd += ["--prompts-per-rank", str(args.prompts_per_rank), "--steps", str(args.steps)]
        env = {"CUDA_VISIBLE_DEVICES": "", "MALLOC_MMAP_THRESHOLD_": "65536"}
        run_ranks(cmd, world, env=env, timeout_s=600)  # fails with each failed rank's output
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    # The first step pays one-time costs (page cache, allocator growth); report the others.
    return busiest_process(mode, world, ranks, first_step=1)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _split_markdown(path: Path) -> tuple[str, str]:
    """(the payload-only part, the full-step section with its leading blank line) of a report."""
    text = path.read_text() if path.is_file() else ""
    at = text.find(FULL_STEP_HEADING)
    if at < 0:
        return text, ""
    return text[:at].rstrip("\n") + "\n", "\n" + text[at:]


def launch_step(mode: str, world: int, data: Path, model_dir: Path, args: argparse.Namespace):
    from yatt.testing import run_ranks

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--worker", mode, str(data), out]
        cmd += ["--prompts-per-rank", str(args.prompts_per_rank), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--group-size", str(args.group_size)]
        cmd += ["--max-new-tokens", str(args.max_new_tokens), "--device", args.device]
        cmd += ["--model-dir", str(model_dir)]
        env = {"MALLOC_MMAP_THRESHOLD_": "65536"}  # see the module docstring
        if args.device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        run_ranks(cmd, world, env=env, timeout_s=900)  # fails with each failed rank's output
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    return summarize_launch(mode, world, ranks)


def _device_slug(num_ranks: int) -> str:
    import torch

    name = torch.cuda.get_device_name(0).lower().replace(" ", "_")
    return f"{re.sub(r'[^a-z0-9_]', '', name)}x{num_ranks}"


def run_full_step(args: argparse.Namespace) -> None:
    """--full-step: each mode of bench/controller/_controller_step.py at each rank count; a report."""
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("--device cuda: no CUDA device here; skipped", flush=True)
            return
        if max(args.ranks) > torch.cuda.device_count():
            raise SystemExit(
                f"--ranks {max(args.ranks)} needs as many GPUs; {torch.cuda.device_count()} here"
            )
    results = []
    t0 = time.perf_counter()
    # "+dirty" when the bench's own files differ from the commit.
    commit = measured_commit(
        ["bench/controller/controller.py", "bench/controller/_controller_step.py"]
    )
    with tempfile.TemporaryDirectory() as root:
        model_dir = make_vlm(Path(root, "vlm"))
        rows = max(args.ranks) * args.prompts_per_rank * (args.warmup + args.steps)
        data = make_shape_dataset(Path(root), rows + max(args.ranks))
        sizes = measure_payload_mib(model_dir, data)
        for world in args.ranks:
            for mode in STEP_MODES:
                results.append(launch_step(mode, world, data, model_dir, args))
                r = results[-1]
                gpu = ""
                if "per_rank_gpu_peak_mib" in r:
                    gpu = f"  GPU peak {max(r['per_rank_gpu_peak_mib']):.1f} MiB"
                print(
                    f"{mode:12s} ranks={world}  busiest peak {r['busiest_peak_mib']:7.1f} MiB"
                    f"  (rank {r['busiest_rank']}){gpu}  step {r['step_s']:.3f} s",
                    flush=True,
                )
    by = {(r["mode"], r["ranks"]): r for r in results}
    # One rank's payload per step, the unit in which growth is judged: its decoded images and
    # their pixel_values (what a rank's controller holds of its own prompts).
    share_mib = args.prompts_per_rank * (sizes["image_mib"] + sizes["pixel_values_mib"])
    slope = {
        m: _slope(args.ranks, [by[m, w]["busiest_peak_mib"] for w in args.ranks])
        for m in STEP_MODES
    }
    passed = None
    if len(args.ranks) > 1:
        passed = slope["yatt-step"] < 0.25 * share_mib and slope["driver-step"] >= share_mib
    summary = {
        "commit": commit,
        "device": args.device,
        "config": {
            "prompts_per_rank": args.prompts_per_rank,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "image_size": [IMAGE_SIZE_STEP, IMAGE_SIZE_STEP, 3],
            **sizes,
            "judge": "reward function (count_reward in bench/controller/_controller_step.py)",
            "cpu_count": os.cpu_count(),
        },
        "results": results,
        "payload_share_mib": share_mib,
        "peak_slope_mib_per_rank": slope,
        "payload_share_is": "prompts_per_rank x (image_mib + pixel_values_mib)",
        "bar": "busiest-process peak slope per added rank: yatt < 0.25 share, driver >= 1 share",
        "passed": passed,
        "wall_s": time.perf_counter() - t0,
    }
    lines = _full_step_report(summary, args)
    if args.device == "cuda":
        stem = f"controller_{_device_slug(max(args.ranks))}"
        write_report(args.out_dir / f"{stem}.md", "\n".join(lines), data=summary)
    else:
        path = args.out_dir / "controller_cpu.json"
        md_path = args.out_dir / "controller_cpu.md"
        head, _ = _split_markdown(md_path)
        write_report(
            md_path,
            head + ("\n" if head else "") + "\n".join(lines),
            data={**_read_json(path), FULL_STEP_KEY: summary},
            json_path=path,
        )
    print("\n".join(lines))


def _slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares growth per added rank (0 with one rank count)."""
    return float(np.polyfit(xs, ys, 1)[0]) if len(set(xs)) > 1 else 0.0


def _full_step_report(summary: dict, args: argparse.Namespace) -> list[str]:
    cfg = summary["config"]
    by = {(r["mode"], r["ranks"]): r for r in summary["results"]}
    is_cuda = args.device == "cuda"
    lines = [
        f"{FULL_STEP_HEADING} (commit {summary['commit']}, {args.device})",
        "",
        "`python bench/controller/controller.py --full-step"
        + (" --device cuda" if is_cuda else "")
        + f" --ranks {' '.join(map(str, args.ranks))}`: every step is the whole GRPO step on a "
        f"tiny Qwen2-VL (bench/controller/_controller_step.py): {cfg['prompts_per_rank']} prompts per rank, "
        f"each a drawn {IMAGE_SIZE_STEP}x{IMAGE_SIZE_STEP} RGB PNG of 1-4 shapes "
        f"({cfg['image_mib'] * 1024:.0f} KiB decoded, {cfg['pixel_values_mib'] * 1024:.0f} KiB "
        f"of float32 pixel_values after the image processor), {cfg['group_size']} samples each "
        f"of up to {cfg['max_new_tokens']} tokens from the built-in engine with the image, a "
        "reward-function judge (the shape count), GRPO advantages, balancing, old logprobs, "
        "a TorchPolicy (DDP) train step and the weights back into the engine. "
        f"{cfg['warmup_steps']} warm-up step(s), then {cfg['timed_steps']} measured: peak RSS "
        "above each process's RSS before them (busiest process), median step time (max over "
        f"ranks). {cfg['cpu_count']} CPU cores, "
        + (
            "NCCL + gloo."
            if is_cuda
            else "gloo; with more ranks than cores the step times "
            "include time-sharing, for both modes alike."
        ),
        "",
    ]
    header = (
        "| ranks | busiest peak RSS (MiB): yatt | driver | step (s): yatt | driver "
        "| samples moved in by balancing (yatt, max) |"
    )
    rule = "|---:|---:|---:|---:|---:|---:|"
    if is_cuda:
        header += " GPU peak above start per rank (MiB): yatt | driver |"
        rule += "---:|---:|"
    lines += [header, rule]
    for world in args.ranks:
        y, d = by["yatt-step", world], by["driver-step", world]
        row = (
            f"| {world} | {y['busiest_peak_mib']:.1f} | {d['busiest_peak_mib']:.1f} "
            f"| {y['step_s']:.3f} | {d['step_s']:.3f} "
            f"| {y['max_moved_in_per_step']} of {cfg['prompts_per_rank'] * cfg['group_size']} |"
        )
        if is_cuda:
            row += " {} | {} |".format(
                *(
                    " / ".join(f"{x:.1f}" for x in r["per_rank_gpu_peak_above_start_mib"])
                    for r in (y, d)
                )
            )
        lines.append(row)
    slope = summary["peak_slope_mib_per_rank"]
    passed = summary["passed"]
    verdict = "n/a (one rank count)" if passed is None else ("PASS" if passed else "FAIL")
    lines += [
        "",
        "yatt: every rank loads its own rows and images, generates, judges and rebalances "
        "them (Batch.rebalance moves the samples the plan moves, images included). driver: "
        "rank 0 also drives, as a single-controller framework's driver does: it loads and "
        "processes every rank's images, scatters each rank's prompts with their images, gets "
        "every completion back, judges them all, balances over the ranks and scatters the "
        "training batches (pickled objects).",
        "",
        f"Busiest-process peak per added rank (least squares): yatt {slope['yatt-step']:.1f} "
        f"MiB, driver {slope['driver-step']:.1f} MiB; one rank's payload per step (decoded "
        f"images + pixel_values) is {summary['payload_share_mib']:.1f} MiB, of which the "
        f"decoded images are {cfg['prompts_per_rank'] * cfg['image_mib']:.1f} MiB. "
        f"Bar (yatt < 0.25 share, driver >= 1 share): {verdict}.",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--prompts-per-rank", type=int, help="default 32; 8 with --full-step (each has 2 samples)"
    )
    parser.add_argument("--steps", type=int, help="default 3; 2 timed with --full-step")
    parser.add_argument(
        "--full-step",
        action="store_true",
        help="the whole GRPO step with a tiny VLM (rollout, judge, balance, train) per mode",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--full-step")
    parser.add_argument("--warmup", type=int, default=1, help="--full-step: untimed steps first")
    parser.add_argument("--group-size", type=int, default=2, help="--full-step: samples/prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="--full-step")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where results go")
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)  # set by the parent for workers
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "DATA", "OUT"))
    args = parser.parse_args()
    if args.prompts_per_rank is None:
        args.prompts_per_rank = 8 if args.full_step else 32
    if args.steps is None:
        args.steps = 2 if args.full_step else 3
    if args.device == "cuda" and not args.full_step:
        parser.error("--device cuda measures --full-step only (the payload-only mode is CPU)")
    if args.worker:
        mode, data, out = args.worker
        if mode in STEP_MODES:
            run_step_worker(mode, data, out, args)
        else:
            worker(mode, data, args.prompts_per_rank, args.steps, out)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.full_step:
        run_full_step(args)
    else:
        run_payload_only(args)


def run_payload_only(args: argparse.Namespace) -> None:
    """The payload-only measurement (the module docstring's modes) into controller_cpu.*."""
    rows_needed = max(args.ranks) * args.prompts_per_rank * args.steps
    image_mib = int(np.prod(IMAGE_SHAPE)) / 2**20
    results = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as root:
        data = _make_dataset(Path(root), rows_needed + max(args.ranks), num_images=16)
        for world in args.ranks:
            for mode in MODES:
                results.append(launch(mode, world, data, args))
                r = results[-1]
                print(
                    f"{mode:12s} ranks={world}  busiest peak {r['busiest_peak_mib']:7.1f} MiB"
                    f"  (rank {r['busiest_rank']})  step {r['step_s']:.3f} s",
                    flush=True,
                )
    by = {(r["mode"], r["ranks"]): r for r in results}
    # One rank's decoded payload per step: the unit in which growth is judged.
    share_mib = args.prompts_per_rank * image_mib
    slope = {
        m: float(np.polyfit(args.ranks, [by[m, w]["busiest_peak_mib"] for w in args.ranks], 1)[0])
        for m in MODES
    }
    # Flat: each added rank adds under a quarter of one rank's payload to yatt's busiest
    # process; linear: the driver gains at least one full share per added rank.
    passed = slope["yatt"] < 0.25 * share_mib and slope["baseline"] >= share_mib
    summary = {
        "config": {
            "prompts_per_rank": args.prompts_per_rank,
            "steps": args.steps,
            "image_shape": list(IMAGE_SHAPE),
            "image_mib": image_mib,
            "cpu_count": os.cpu_count(),
        },
        "results": results,
        "payload_share_mib": share_mib,
        "peak_slope_mib_per_rank": slope,
        "bar": "busiest-process peak slope per added rank: yatt < 0.25 share, baseline >= 1 share",
        "passed": passed,
        "wall_s": time.perf_counter() - t0,
    }
    # The full-step section, when an earlier --full-step run wrote one, stays.
    previous = _read_json(args.out_dir / "controller_cpu.json")
    if FULL_STEP_KEY in previous:
        summary[FULL_STEP_KEY] = previous[FULL_STEP_KEY]
    lines = [
        "# Controller memory: per-rank controllers (yatt) vs one driver (baseline), CPU",
        "",
        f"{args.prompts_per_rank} prompts per rank per step, each with a {IMAGE_SHAPE} uint8 image "
        f"({image_mib * 1024:.0f} KiB); peak RSS above each process's start, busiest process; "
        f"median step time over steps 2..{args.steps} (max over ranks). "
        f"{os.cpu_count()} CPU cores, gloo; with more ranks than cores the step times "
        "include time-sharing, for both modes alike.",
        "",
        "| ranks | busiest peak (MiB): yatt | yatt+balance | baseline "
        "| step (s): yatt | yatt+balance | baseline | samples moved in (max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world in args.ranks:
        y, yb, b = (by[m, world] for m in MODES)
        lines.append(
            f"| {world} | {y['busiest_peak_mib']:.1f} | {yb['busiest_peak_mib']:.1f} "
            f"| {b['busiest_peak_mib']:.1f} | {y['step_s']:.3f} | {yb['step_s']:.3f} "
            f"| {b['step_s']:.3f} | {yb['max_moved_in_per_step']} of {args.prompts_per_rank} |"
        )
    lines += [
        "",
        "yatt: each rank loads, decodes and processes its own shard. yatt+balance: also "
        "rebalances the samples (with their images) by length through yatt.balance.across_ranks. "
        "baseline: rank 0 loads and decodes every image and scatters them (pickled).",
        "",
        f"Busiest-process peak per added rank (least squares): yatt {slope['yatt']:.1f} MiB, "
        f"yatt+balance {slope['yatt+balance']:.1f} MiB, baseline {slope['baseline']:.1f} MiB; "
        f"one rank's decoded payload per step is {share_mib:.1f} MiB. "
        f"Bar (yatt < 0.25 share, baseline >= 1 share): {'PASS' if passed else 'FAIL'}.",
        "",
    ]
    md_path = args.out_dir / "controller_cpu.md"
    _, full_step_section = _split_markdown(md_path)
    write_report(md_path, "\n".join(lines) + full_step_section, data=summary)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
