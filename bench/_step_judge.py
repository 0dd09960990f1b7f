"""The dedicated layout's judge: its own process (a yatt.genrm HTTP app on one GPU), started
by bench/step.py (`--serve-judge`) and reached with yatt.genrm.GenRMClient."""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import _step_setup as setup


def serve_judge(args: argparse.Namespace) -> None:
    """The dedicated judge: a GenRM over HTTP, on this process's only GPU."""
    import torch
    from aiohttp import web

    from yatt import genrm

    work = setup.workload(args)
    _, judge_dir = setup.make_models(Path(args.model_dir), tiny=args.tiny)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    judge, engine = setup.build_judge(
        judge_dir, device=device, tiny=args.tiny, work=work, slots=work.num_samples
    )
    app = genrm.create_app(judge, max_batch=work.num_samples)
    try:
        web.run_app(app, host="127.0.0.1", port=args.judge_port, print=None)
    finally:
        engine.close()


def start_judge_server(args: argparse.Namespace, script: str) -> subprocess.Popen:
    """The judge's process; it loads while this one builds the policy (wait_for_judge)."""
    cmd = [sys.executable, script, "--serve-judge", "--model-dir", args.model_dir]
    cmd += ["--judge-port", str(args.judge_port), "--judge-tokens", str(args.judge_tokens)]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--prompts", str(args.prompts)] if args.prompts else []
    env = dict(os.environ)
    if args.judge_gpu is not None and not args.tiny:
        env["CUDA_VISIBLE_DEVICES"] = str(setup.physical_gpu(args.judge_gpu))
    return subprocess.Popen(cmd, env=env)


def wait_for_judge(proc: subprocess.Popen, port: int) -> str:
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"judge server exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return url
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("judge server did not answer /health in 180 s")
