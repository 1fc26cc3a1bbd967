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


def _comma_list(text: str) -> list[str]:
    return [item for item in text.replace(",", " ").split() if item]


def _add_report_arguments(parser: argparse.ArgumentParser, preset: str) -> None:
    from shampoo_conformance.report import settings as S

    parser.add_argument(
        "--problems", nargs="+", metavar="NAME",
        help="problems of shampoo_datasets (space or comma separated; default: the preset's)",
    )
    parser.add_argument(
        "--backends", nargs="+", metavar="NAME",
        help=f"backends (default: {' '.join(S.DEFAULT_BACKENDS)}; also torch-ddp, torch-fsdp2, "
        "jax-sharded, and the third-party libraries meta, google, tearfree, pytorch-optimizer, "
        "pytorch-optimizer-shampoo, pytorch-optimizer-soap, heavyball-soap)",
    )
    parser.add_argument(
        "--out", default="shampoo-report", help="output folder (default: %(default)s)"
    )
    parser.add_argument("--seeds", type=int, help="evaluation seeds (default: the preset's)")
    parser.add_argument("--steps", type=int, help="step budget for every problem "
                        "(default: per problem)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--config", metavar="FILE",
        help="a JSON Shampoo config for every backend: ShampooConfig.to_dict() form, or "
        '{"from_meta": {...}} / {"from_google": {...}} with the library\'s arguments, or '
        '{"from_tearfree": {"learning_rate": lr, "options": {...}}} '
        "(default: the report's own, shampoo_conformance.report.settings)",
    )
    parser.set_defaults(preset=preset)


def _report_handler(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    from shampoo_conformance import report
    from shampoo_conformance.backends import known_backends
    from shampoo_conformance.report import settings as S

    def handler(args: argparse.Namespace) -> int:
        for flag, value in (("--seeds", args.seeds), ("--steps", args.steps)):
            if value is not None and value < 1:
                parser.error(f"{flag} must be >= 1, got {value}")
        problems = None if args.problems is None else _flatten(args.problems)
        backends = None if args.backends is None else _flatten(args.backends)
        if problems is not None:
            _check(parser, "--problems", problems, S.available_problems())
        if backends is not None:
            _check(parser, "--backends", backends, known_backends())
        config = None
        if args.config is not None:
            try:
                config = S.load_config(args.config)
            except ValueError as err:
                parser.error(str(err))
        settings = report.settings_for(
            args.preset, problems=problems, backends=backends, out=args.out,
            steps=args.steps, seeds=args.seeds, config=config,
        )
        return report.main(settings, plots=not args.no_plots)

    return handler


def _flatten(items: list[str]) -> list[str]:
    return [name for item in items for name in _comma_list(item)]


def _check(
    parser: argparse.ArgumentParser, flag: str, names: list[str], valid: Sequence[str]
) -> None:
    unknown = [n for n in names if n not in valid]
    if unknown:
        parser.error(
            f"{flag}: unknown {', '.join(map(repr, unknown))}; valid choices: {', '.join(valid)}"
        )


def _add_demo(subparsers: Any) -> None:
    from shampoo_conformance.report import demo

    parser = subparsers.add_parser(
        "demo",
        help="the backend report on a small embedded default (a few minutes)",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_report_arguments(parser, "demo")
    parser.set_defaults(handler=_report_handler(parser))


def _add_report(subparsers: Any) -> None:
    from shampoo_conformance import report

    parser = subparsers.add_parser(
        "report",
        help="accuracy, step time, memory and convergence of every backend, with plots",
        description=report.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_report_arguments(parser, "default")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="preset", action="store_const", const="quick",
                      help="smoke test: demo problems, a quarter of the steps, one seed")
    size.add_argument("--compare", dest="preset", action="store_const", const="compare",
                      help="every library in 15 minutes: demo problems and digits_mlp, "
                      "2 seeds, demo grid, half the steps (nox -s compare's default)")
    size.add_argument("--full", dest="preset", action="store_const", const="full",
                      help="the convergence benchmark: every problem, 5 seeds, full grid")
    parser.set_defaults(handler=_report_handler(parser))


def _add_run(subparsers: Any) -> None:
    from shampoo_conformance.suite import runner

    parser = subparsers.add_parser(
        "run",
        help="run the conformance property suite against one backend",
        description=runner.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backend",
        default="reference",
        help="built-in name (reference, torch, torch-ddp, torch-fsdp2, jax, jax-sharded), a "
        "third-party library (meta, google, tearfree, pytorch-optimizer, "
        "pytorch-optimizer-shampoo, pytorch-optimizer-soap, heavyball-soap), "
        "'mutant:NAME', or 'package.module:factory' (default: %(default)s)",
    )
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")

    def handler(args: argparse.Namespace) -> int:
        return runner.run_suite(args.backend, args.pytest_args)

    parser.set_defaults(handler=handler)


def _add_compare(subparsers: Any) -> None:
    from shampoo_conformance.report import compare

    parser = subparsers.add_parser(
        "compare",
        help="one config through every installed backend: error table vs the reference",
        description=compare.__doc__,
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
            config = compare.load_config(args.config)
        except ValueError as err:
            parser.error(str(err))
        return compare.compare(config, args.steps, args.seed, args.backend)

    parser.set_defaults(handler=handler)


def _add_mutants(subparsers: Any) -> None:
    from shampoo_conformance.suite import runner

    parser = subparsers.add_parser(
        "mutants",
        help="run the suite against every mutant of the reference and print the kill rate",
    )
    parser.set_defaults(handler=lambda args: runner.mutation_report())


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(item) for item in _comma_list(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: allowed positive integers, comma or space separated")
    return values


def _add_scaling(subparsers: Any) -> None:
    from shampoo_conformance.studies import scaling
    from shampoo_conformance.studies.scaling.models import MODELS
    from shampoo_conformance.studies.scaling.outputs import main as run_study
    from shampoo_conformance.studies.scaling.rows import BLOCK_SIZES, SHARD_GROUPS, WORLD_SIZES

    parser = subparsers.add_parser(
        "scaling",
        help="block plan and owners on Llama-2 7B/70B shapes, 8 to 4096 ranks: work, memory, "
        "communication per rank (no device needed)",
        description=scaling.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default="shampoo-scaling",
                        help="output folder (default: %(default)s)")
    parser.add_argument("--models", nargs="+", metavar="NAME",
                        help=f"models (default: all of {', '.join(MODELS)})")
    parser.add_argument("--block-sizes", type=_positive_ints,
                        default=list(BLOCK_SIZES), metavar="B,B",
                        help="blocking.max_preconditioner_dim values (default: %(default)s)")
    parser.add_argument("--world-sizes", type=_positive_ints,
                        default=list(WORLD_SIZES), metavar="N,N",
                        help="world sizes (default: %(default)s)")
    parser.add_argument("--shard-groups", type=_positive_ints,
                        default=list(SHARD_GROUPS), metavar="S,S",
                        help="HSDP shard-group sizes (default: %(default)s)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")

    def handler(args: argparse.Namespace) -> int:
        models = None if args.models is None else _flatten(args.models)
        if models is not None:
            _check(parser, "--models", models, list(MODELS))
        return run_study(args.out, models, args.block_sizes, args.world_sizes,
                         args.shard_groups, plot=not args.no_plot)

    parser.set_defaults(handler=handler)


#: The subcommands, in the order ``--help`` lists them.
SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_demo, _add_report, _add_run, _add_compare, _add_mutants, _add_scaling,
)


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
