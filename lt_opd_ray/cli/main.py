"""`lt-opd`: the command line (its commands live in `jobs`, `models` and `planning`)."""

from __future__ import annotations

import argparse
import sys

from lt_opd_ray.cli import jobs, models, planning


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lt-opd", description="Low-token on-policy self-distillation for VLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for commands in (jobs, models, planning):
        commands.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from lt_opd_ray.core.redact import redacted_process

    argv = list(sys.argv[1:] if argv is None else argv)
    with redacted_process():  # every line printed, and the command line Ray and the trackers record, without credentials
        # `lt-opd submit JOB [options] -- [lt-opd train options]`: what follows -- goes to the remote train
        train_args = argv[argv.index("--") + 1 :] if "--" in argv else []
        argv = argv[: argv.index("--")] if "--" in argv else argv
        args = build_parser().parse_args(argv)
        args.train_args = train_args
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
