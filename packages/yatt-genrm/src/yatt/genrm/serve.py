"""Serve a GenRM over HTTP: `python -m yatt.genrm.serve --model DIR --port 8000`.

POST /score {"samples": [...]} -> {"verdicts": [...]};  GET /health
The judge runs on yatt.rollout's built-in engine; GenRMClient(url) is the other end.
With an API key (`YATT_GENRM_API_KEY=... python -m yatt.genrm.serve ...`, or `--api-key`, which
other users of the machine can read in the process list) /score needs
`Authorization: Bearer <key>`; GenRMClient sends it from the same variable.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from yatt.genrm._genrm import GenRM
from yatt.genrm._parsers import ScoreParser, VerdictParser, YesNoParser
from yatt.genrm._server import create_app
from yatt.genrm._stream import BatchingConfig
from yatt.genrm._templates import JudgeTemplate, pointwise_template, verification_template
from yatt.rollout import SamplingParams

__all__ = ["TEMPLATES", "build_genrm", "build_parser", "load_engine", "main"]

TEMPLATES = ("verification", "verification-no-reference", "pointwise")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m yatt.genrm.serve", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", required=True, help="judge model directory (Hugging Face layout)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-seq-len", type=int, default=8192, help="judge context (prompt+verdict)")
    p.add_argument("--template", choices=TEMPLATES, default="verification")
    p.add_argument(
        "--template-file",
        type=Path,
        default=None,
        help="user template text with {prompt} {response} {reference} fields (overrides "
        "--template's text; its verdict is parsed as --template's)",
    )
    p.add_argument("--score-low", type=int, default=1, help="pointwise scale low end")
    p.add_argument("--score-high", type=int, default=10, help="pointwise scale high end")
    p.add_argument(
        "--occurrence",
        choices=("first", "last"),
        default="last",
        help="which of several boxed or marker verdicts ('Verdict: No', 'Score: 7') counts",
    )
    p.add_argument("--votes", type=int, default=1)
    p.add_argument("--aggregate", choices=("mean", "majority"), default="mean")
    p.add_argument("--temperature", type=float, default=None, help="default: 0, or 0.7 with votes")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--max-response-tokens", type=int, default=4096)
    p.add_argument("--default-reward", type=float, default=0.0)
    p.add_argument("--max-batch", type=int, default=256, help="most samples in one request (413)")
    p.add_argument(
        "--engine-batch", type=int, default=32, help="samples per engine call (= engine slots)"
    )
    p.add_argument("--batch-window-millis", type=float, default=20.0)
    p.add_argument("--max-pending", type=int, default=1024)
    p.add_argument(
        "--max-body-mib", type=float, default=64.0, help="largest request body (413 beyond)"
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=60.0,
        help="seconds to receive a request body (408 beyond): a trickling client cannot hold "
        "a handler",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("YATT_GENRM_API_KEY"),
        help="require 'Authorization: Bearer <key>' on /score (default: $YATT_GENRM_API_KEY; "
        "none: open)",
    )
    return p


def build_genrm(args: argparse.Namespace, engine: Any) -> GenRM:
    """The GenRM that `args` describe, over `engine` (ValueError names a bad flag)."""
    parser: VerdictParser
    if args.template == "pointwise":
        template = pointwise_template(
            low=args.score_low, high=args.score_high, max_response_tokens=args.max_response_tokens
        )
        parser = ScoreParser(low=args.score_low, high=args.score_high, occurrence=args.occurrence)
    else:
        template = verification_template(
            with_reference=args.template == "verification",
            max_response_tokens=args.max_response_tokens,
        )
        parser = YesNoParser(occurrence=args.occurrence)
    if args.template_file is not None:
        template = JudgeTemplate(
            user=args.template_file.read_text(),
            system=template.system,
            max_response_tokens=args.max_response_tokens,
        )
    sampling = None
    if args.temperature is not None or args.max_new_tokens != 512:
        temperature = args.temperature
        if temperature is None:
            temperature = 0.0 if args.votes == 1 else 0.7
        sampling = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
    return GenRM(
        engine,
        template=template,
        parser=parser,
        votes=args.votes,
        sampling=sampling,
        aggregate=args.aggregate,
        default_reward=args.default_reward,
        batching=BatchingConfig(
            max_batch_size=args.engine_batch,
            batch_window_millis=args.batch_window_millis,
            max_pending=args.max_pending,
            # Later batches join the built-in engine's running decode loop (free slots).
            max_inflight_batches=16,
        ),
    )


def load_engine(args: argparse.Namespace) -> Any:
    """yatt.rollout's built-in engine over the model directory."""
    from yatt.rollout import BuiltinEngine, EngineConfig

    config = EngineConfig(
        device=args.device,
        dtype=args.dtype,
        max_batch_size=args.engine_batch,
        max_seq_len=args.max_seq_len,
        max_prefill_tokens=max(16384, args.max_seq_len),
        # The judge shares the process with nothing else here, but keep its memory tags apart
        # from a rollout engine's in case both are colocated.
        region_prefix="genrm",
    )
    return BuiltinEngine(args.model, config=config)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.max_batch < 1:
        raise SystemExit(f"--max-batch={args.max_batch}: must be >= 1")
    if not args.max_body_mib > 0:
        raise SystemExit(f"--max-body-mib={args.max_body_mib}: must be > 0")
    if not args.body_timeout_s > 0:
        raise SystemExit(f"--body-timeout-s={args.body_timeout_s}: must be > 0")
    if args.api_key is not None and not args.api_key.strip():
        raise SystemExit("--api-key (or YATT_GENRM_API_KEY) is empty: set a key or unset it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        engine = load_engine(args)
        genrm = build_genrm(args, engine)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    app = create_app(
        genrm,
        max_batch=args.max_batch,
        max_body_bytes=int(args.max_body_mib * (1 << 20)),
        body_timeout_s=args.body_timeout_s,
        api_key=args.api_key,
    )
    try:
        web.run_app(app, host=args.host, port=args.port)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
