"""``rlinf demo``: a real RL job on an embedded local cluster.

Rollout workers (CPU processes) play CartPole-v1 with a small torch MLP and put each
finished episode — a dict of tensors (observations, actions, rewards, returns) — into a
channel, with the episode length as its weight. Learner workers take batches of about
equal weight (``get_batch(target_weight=...)``), compute a REINFORCE gradient, sum the
gradients with ``all_reduce``, and learner 0 broadcasts the new weights to the rollout
workers every iteration. It stops when the mean return over the recent episodes reaches
the target, or at the iteration cap, and prints a report.

Importing this package is light (no torch); the job itself lives in :mod:`.app`
(driver) and :mod:`.workers` (worker processes), the algorithm in :mod:`.rl`.
"""

from __future__ import annotations

import argparse

from .options import POLICIES

__all__ = ["DESCRIPTION", "add_arguments", "run", "main"]

DESCRIPTION = ("Train CartPole-v1 on a local cluster: rollout workers put episodes into a channel "
               "(weight = episode length), learners take balanced batches, average gradients with "
               "all_reduce, and learner 0 broadcasts the new weights every iteration. Shows progress, "
               "stops when solved (or at the iteration cap) and prints a report.")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rollouts", type=int, default=2, metavar="N", help="rollout workers (default 2)")
    parser.add_argument("--learners", type=int, default=2, metavar="M", help="learner workers (default 2)")
    parser.add_argument("--policy", default="fifo", metavar="NAME",
                        help=f"the channel's load-balancing policy: {', '.join(POLICIES)} (default fifo)")
    parser.add_argument("--iterations", type=int, default=None, metavar="K",
                        help="iteration cap (default 60; 10 with --quick)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    parser.add_argument("--target", type=float, default=None, metavar="R",
                        help="stop when the mean return of the recent episodes reaches R "
                             "(default 475, CartPole-v1's 'solved' threshold)")
    parser.add_argument("--window", type=int, default=50, help="episodes in the recent mean (default 50)")
    parser.add_argument("--steps-per-iter", type=int, default=4000, metavar="STEPS",
                        help="environment steps the learners consume per iteration (default 4000)")
    parser.add_argument("--envs", type=int, default=8, help="environments per rollout worker (default 8)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run (what the tests use): 10 iterations unless --iterations is given")
    parser.add_argument("--plain", action="store_true",
                        help="print one line per iteration instead of a live display")
    parser.add_argument("--summary", metavar="FILE", help="also write the final report as JSON to FILE")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="give up after this many seconds (default 300)")


def run(args: argparse.Namespace) -> int:
    """Run the demo with parsed arguments; returns the exit status."""
    from .app import run as _run

    return _run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlinf demo", description=DESCRIPTION)
    add_arguments(parser)
    return run(parser.parse_args(argv))
