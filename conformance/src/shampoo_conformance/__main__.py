"""Command line: ``python -m shampoo_conformance SUBCOMMAND ...``.

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its
arguments and sets ``handler`` (a function of the parsed namespace returning
the exit status); adding a subcommand means writing one such function and
listing it in :data:`SUBCOMMANDS`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any


def _add_demo(subparsers: Any) -> None:
    from . import demo

    parser = subparsers.add_parser(
        "demo",
        help="Shampoo (reference backend) next to gradient descent on a small problem",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--problem",
        default=demo.DEFAULT_PROBLEM,
        choices=sorted(demo.TUNED_LEARNING_RATES),
        help="problem from shampoo_datasets (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=demo.DEFAULT_STEPS, help="steps (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="problem seed (default: 0)")

    def handler(args: argparse.Namespace) -> int:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        return demo.main(args.problem, steps=args.steps, seed=args.seed)

    parser.set_defaults(handler=handler)


def _add_run(subparsers: Any) -> None:
    from . import runner

    parser = subparsers.add_parser(
        "run",
        help="run the conformance property suite against one backend",
        description=runner.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        default="reference",
        help="built-in name (reference, torch, jax), 'mutant:NAME', or "
        "'package.module:factory' (default: %(default)s)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")

    def handler(args: argparse.Namespace) -> int:
        return runner.run_suite(args.backend, args.pytest_args)

    parser.set_defaults(handler=handler)


def _add_compare(subparsers: Any) -> None:
    from . import comparison

    parser = subparsers.add_parser(
        "compare",
        help="one config through every installed backend: error table vs the reference",
        description=comparison.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="JSON file of a ShampooConfig (default: defaults)")
    parser.add_argument("--steps", type=int, default=10, help="steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default: %(default)s)")
    parser.add_argument("--backend", action="append", help="backend(s) (default: all built-in)")

    def handler(args: argparse.Namespace) -> int:
        if args.steps < 1:
            parser.error(f"--steps must be >= 1, got {args.steps}")
        try:
            config = comparison.load_config(args.config)
        except ValueError as err:
            parser.error(str(err))
        return comparison.compare(config, args.steps, args.seed, args.backend)

    parser.set_defaults(handler=handler)


def _add_mutants(subparsers: Any) -> None:
    from . import runner

    parser = subparsers.add_parser(
        "mutants",
        help="run the suite against every mutant of the reference and print the kill rate",
    )
    parser.set_defaults(handler=lambda args: runner.mutation_report())


#: The subcommands, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (_add_demo, _add_run, _add_compare, _add_mutants)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per entry of :data:`SUBCOMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="python -m shampoo_conformance",
        description="Check Shampoo backends against the spec and the float64 reference.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
