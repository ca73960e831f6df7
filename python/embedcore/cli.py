"""The ``embedcore`` command line (also ``python -m embedcore``)."""
from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="embedcore", description="embedcore: embedding tables in one native engine")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    demo = sub.add_parser("demo", help="train a small click-through model on synthetic data")
    demo.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    demo.add_argument("--batch-size", type=int, default=512)
    demo.add_argument("--threads", type=int, default=None, help="engine threads (default: all cores)")
    demo.add_argument("--seed", type=int, default=0)

    sub.add_parser("info", help="print what this build holds")

    args = parser.parse_args(argv)
    if args.version:
        from . import __version__

        print(__version__)
        return 0
    if args.command == "demo":
        from .demo import run

        return run(steps=args.steps, batch_size=args.batch_size, threads=args.threads, seed=args.seed)
    if args.command == "info":
        from . import build_info

        print(json.dumps(build_info(), indent=2))
        return 0
    parser.print_help(sys.stderr)
    return 2
