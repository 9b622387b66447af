"""Command line: `structkv demo` (the main job on the embedded default model), `eval`, `generate`,
`bench`, `serve`; one file per subcommand, their shared options in `options.py`."""
from __future__ import annotations

import argparse
import os
import sys

from . import bench, evaluate, generate, serve
from .options import ARCHIVE_KINDS, DECODE_RULES  # noqa: F401 (tests and tools read them here)

# Commands that run beside other work (a server, an interactive answer) wait for work passively;
# eval and bench keep OpenMP's default, so their speed figures stay comparable with earlier ones.
SHARES_THE_MACHINE = ("generate", "serve")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="structkv", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    evaluate.add_demo_parser(sub)
    generate.add_parser(sub)
    evaluate.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    args = p.parse_args(argv)
    if args.command in SHARES_THE_MACHINE:
        # OpenMP's default spins while it waits for work; on a busy machine that loses most of a
        # process's fair share (research/benchmarks_log.md, "Threads on a busy machine"). Read when torch
        # loads OpenMP, so set before the command imports it; an explicit setting wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        code = args.fn(args)
    except (ValueError, TypeError, OSError, ImportError) as e:  # OSError: missing files, permissions, full disk
        print(f"structkv: error: {e}", file=sys.stderr)
        code = 2
    if getattr(args, "tp", None) and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            from structkv.distributed.group import exit_process

            exit_process(code)  # does not return
    return code


if __name__ == "__main__":
    sys.exit(main())
