"""The ``rlinf`` command: ``rlinf manager | top | bench | demo | trace``.

Each subcommand lives in its own module and is imported only when used, so
``rlinf --help`` and ``rlinf top`` start fast and do not need torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from ..config import Settings

__all__ = ["main", "build_parser"]


# ----------------------------------------------------------------------------- manager
def _manager_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default="tcp://0.0.0.0:5555",
                        help="ZeroMQ endpoint to listen on (default %(default)s; port 0 picks a free one)")
    parser.add_argument("--token", default=None,
                        help="cluster token (default $RLINF_TOKEN; when neither is given a new one is "
                             "generated and printed)")
    parser.add_argument("--peer-timeout", type=float, default=None,
                        help="seconds without a heartbeat before a worker is declared lost "
                             "(default $RLINF_PEER_TIMEOUT or 2.5)")
    parser.add_argument("--quiet", action="store_true", help="do not log membership changes")


def _join_addresses(address: str) -> list[str]:
    """Endpoints other machines can use: a wildcard bind is expanded to this host's IPs."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or host not in ("0.0.0.0", "*", "[::]", "::"):
        return [address]
    from ..control import devices

    return [f"tcp://{ip}:{port}" for ip in devices.host_addresses()]


async def _serve_manager(args: argparse.Namespace) -> None:
    from ..control.manager import Manager

    settings = Settings.from_env()    # here, not in the parser: --help works with a bad knob
    token = args.token or settings.token
    async with Manager(args.bind, token=token, peer_timeout=args.peer_timeout, settings=settings) as manager:
        joins = _join_addresses(manager.address)
        print(f"rlinf manager listening on {manager.address}", flush=True)
        if token is None:
            print(f"generated cluster token: {manager.token}", flush=True)
            print("  (keep it secret; pass it with --token or RLINF_TOKEN next time to keep it)", flush=True)
        print("workers join with:", flush=True)
        for endpoint in joins:
            print(f"  RLINF_MANAGER={endpoint} RLINF_TOKEN=<token> python your_worker.py", flush=True)
        print(f"watch it with:\n  rlinf top --manager {joins[0]} --token <token>", flush=True)
        await asyncio.Event().wait()


def _cmd_manager(args: argparse.Namespace) -> int:
    from ..control import client as control

    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO,
                        format="%(asctime)s %(message)s")
    try:
        control.run(_serve_manager(args))
    except (OSError, ValueError) as exc:   # cannot bind; a bad --peer-timeout or RLINF_* variable
        print(f"rlinf manager: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rlinf manager: stopped", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- others
def _cmd_top(args: argparse.Namespace) -> int:
    from . import top

    return top.run(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from . import bench

    return bench.run(args)


def _cmd_trace(args: argparse.Namespace) -> int:
    from . import trace

    return trace.run(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .. import demo

    return demo.run(args)


def build_parser() -> argparse.ArgumentParser:
    from ..version import __version__

    parser = argparse.ArgumentParser(
        prog="rlinf", description="rlinf: asyncio-native messaging for distributed reinforcement learning.",
        epilog="Run 'rlinf COMMAND --help' for the options of a command.")
    parser.add_argument("--version", action="version", version=f"rlinf {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("manager", help="run a standalone manager (the cluster registry)",
                       description="Run a standalone rlinf manager. Workers on any machine join it with "
                                   "RLINF_MANAGER and RLINF_TOKEN.")
    _manager_arguments(p)
    p.set_defaults(func=_cmd_manager)

    from . import top

    p = sub.add_parser("top", help="live view of a running cluster",
                       description="Live view of a running cluster: workers, traffic, channels, events.")
    top.add_arguments(p)
    p.set_defaults(func=_cmd_top)

    from . import bench

    p = sub.add_parser("bench", help="run the benchmark suite beside its baselines",
                       description="Run the benchmarks (codec, p2p, transfer, collectives, channel, ...) "
                                   "and print one table: rlinf beside each baseline, measured in the same "
                                   "run, with the ratio and the target.")
    bench.add_arguments(p)
    p.set_defaults(func=_cmd_bench)

    from .. import demo

    p = sub.add_parser("demo", help="train CartPole with rollout workers, a channel and learners",
                       description=demo.DESCRIPTION)
    demo.add_arguments(p)
    p.set_defaults(func=_cmd_demo)

    from . import trace

    p = sub.add_parser("trace", help="merge the timeline files RLINF_TRACE=DIR wrote into one",
                       description="Work with the timeline trace that RLINF_TRACE=DIR (or rlinf.trace(DIR)) "
                                   "writes, one file per process.")
    trace.add_arguments(p)
    p.set_defaults(func=_cmd_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rlinf`` command (and ``python -m rlinf``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
