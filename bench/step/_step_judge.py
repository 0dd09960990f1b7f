"""The dedicated layout's judge pool: one process per judge GPU (a yatt.genrm HTTP app on that
GPU), started by bench/step/step.py (`--serve-judge`) and reached with yatt.genrm.GenRMClient over
all of them (the judge data-parallel).

Ports: server k of --judge-gpus listens on --judge-port + k, on 127.0.0.1. The node's local
rank 0 starts the pool; every rank of the node waits until each server answers /health.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import _step_setup as setup

STARTUP_S = 300  # a 1.5B judge's engine loads and allocates its KV cache in well under this


def serve_judge(args: argparse.Namespace) -> None:
    """One judge server: a GenRM over HTTP, on this process's only GPU."""
    import torch
    from aiohttp import web

    from yatt import genrm

    if args.tiny:  # tiny models gain nothing from intra-op threads on a shared CPU
        torch.set_num_threads(1)
    work = setup.workload(args)  # --prompts: the run's global count, resolved by the policy
    shapes = setup.shape_names(args)
    _, judge_dir = setup.make_models(Path(args.model_dir), tiny=args.tiny, shapes=shapes)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    slots = args.judge_slots or work.num_samples
    judge, engine = setup.build_judge(
        judge_dir, device=device, tiny=args.tiny, work=work, slots=slots
    )
    app = genrm.create_app(judge, max_batch=work.num_samples)
    try:
        web.run_app(app, host="127.0.0.1", port=args.judge_port, print=None)
    finally:
        engine.close()


def check_judge_gpus(judge_gpus: list[int], runtime: Any) -> None:
    """On CUDA: the judge GPUs (CUDA indices, as the ranks' LOCAL_RANK devices are) exist and
    none of them is a policy rank's."""
    import torch

    if runtime.device.type != "cuda":
        return  # CPU runs: the judge processes stand for the GPUs
    count = torch.cuda.device_count()
    if max(judge_gpus) >= count:
        raise ValueError(f"--judge-gpus {judge_gpus}: this node has {count} visible GPUs")
    policy = set(range(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    if set(judge_gpus) & policy:
        raise ValueError(
            f"--judge-gpus {judge_gpus}: GPU(s) {sorted(set(judge_gpus) & policy)} also run a "
            f"policy rank (ranks use GPUs {sorted(policy)}); list GPUs after the policy's, e.g. "
            "--nproc_per_node 6 --judge-gpus 6,7"
        )


def start_judge_servers(
    args: argparse.Namespace, script: str, work: setup.Workload
) -> list[subprocess.Popen]:
    """The pool's processes, one per --judge-gpus entry; they load while the policy builds
    (wait_for_judges). Each takes the run's global workload and slots for its share of it."""
    num_servers = len(args.judge_gpus)
    slots = -(-work.num_samples // num_servers)
    procs = []
    for k, gpu in enumerate(args.judge_gpus):
        cmd = [sys.executable, script, "--serve-judge", "--model-dir", args.model_dir]
        cmd += ["--judge-port", str(args.judge_port + k), "--judge-tokens", str(args.judge_tokens)]
        cmd += ["--prompts", str(work.num_prompts), "--judge-slots", str(slots)]
        cmd += ["--shape", args.shape]
        cmd += ["--judge-shape", args.judge_shape] if args.judge_shape else []
        cmd += ["--tiny"] if args.tiny else []
        env = dict(os.environ)
        if not args.tiny:
            env["CUDA_VISIBLE_DEVICES"] = str(setup.physical_gpu(gpu))
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            env.pop(name, None)  # a server is no torchrun rank
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def wait_for_judges(procs: list[subprocess.Popen], port: int, num_servers: int) -> list[str]:
    """The pool's URLs once every server answers /health. `procs`: the servers this process
    started (local rank 0), watched for an early exit; other ranks only poll."""
    urls = [f"http://127.0.0.1:{port + k}" for k in range(num_servers)]
    deadline = time.monotonic() + STARTUP_S
    waiting = list(urls)
    while waiting and time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"a judge server exited with {proc.returncode}")
        for url in list(waiting):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(url + "/health", timeout=2).read()
                waiting.remove(url)
        if waiting:
            time.sleep(0.5)
    if waiting:
        for proc in procs:
            proc.kill()
        raise RuntimeError(f"judge server(s) {waiting} did not answer /health in {STARTUP_S} s")
    return urls


def pool_record(ctx: Any) -> list[dict[str, Any]]:
    """Per server of the pool: its GPU, URL and the load it served over the whole run (warm-up
    steps included, every rank's requests), from its own /health."""
    out = []
    for gpu, (url, health) in zip(ctx.judge_gpus, ctx.judge.health_all().items(), strict=True):
        metrics = health["metrics"]
        out.append(
            {
                "gpu": gpu,
                "url": url,
                **{k: metrics.get(k) for k in ("num_samples", "num_batches", "num_prompt_tokens")},
                "sent_by_rank0": ctx.judge.num_samples_by_url[url],
            }
        )
    return out
