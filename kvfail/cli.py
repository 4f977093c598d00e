"""The ``kvfail`` command."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfail", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="show kvfail's log lines")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show the mixin at work with vLLM's own types")
    demo.add_argument("--deadline", type=float, default=0.3, help="watchdog deadline (s)")
    from kvfail.audit.cli import add_parser as add_audit_parser

    add_audit_parser(sub)
    from kvfail.audit.matrix import add_parser as add_matrix_parser

    add_matrix_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.CRITICAL,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        from kvfail.demo import run

        return run(deadline_s=args.deadline)
    if args.command == "audit":
        from kvfail.audit.cli import command_started_at
        from kvfail.audit.cli import run as run_audit

        return run_audit(args, started_at=command_started_at())
    if args.command == "matrix":
        from kvfail.audit.matrix import run as run_matrix

        return run_matrix(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
