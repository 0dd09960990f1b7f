"""What a carried site-packages gives the device machine: each module imported (ok or the error),
and each requirement of the named distributions that the machine does not meet.

    python3 bench/_common/probe_site.py --tag vllm --modules vllm,vllm.entrypoints.llm --dists vllm

bench/rollout/engines_gpu.sh and bench/verl/verl_gpu.sh run it with the site first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md

from packaging.requirements import Requirement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tag", default="", help="prefix of every line (e.g. the engine)")
    parser.add_argument("--modules", default="", help="comma-separated modules to import")
    parser.add_argument("--dists", default="", help="comma-separated distributions to check")
    args = parser.parse_args()
    tag = f"{args.tag} " if args.tag else ""
    for name in filter(None, args.modules.split(",")):
        try:
            module = importlib.import_module(name)
            print(f"{tag}import ok", name, getattr(module, "__version__", ""))
        except Exception as e:
            print(f"{tag}import FAIL", name, type(e).__name__, str(e)[:300])
    for dist in filter(None, args.dists.split(",")):
        for req in md.requires(dist) or []:
            r = Requirement(req)
            if r.marker and not r.marker.evaluate({"extra": ""}):
                continue
            try:
                got = md.version(r.name)
                if got not in r.specifier:
                    print(f"{tag}{dist} version", r.name, got, "wanted", r.specifier)
            except md.PackageNotFoundError:
                print(f"{tag}{dist} missing", r.name)


if __name__ == "__main__":
    main()
