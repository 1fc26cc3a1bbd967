"""Where pytorch-optimizer 4.1.0's ``ScalableShampoo`` as shipped differs from the spec.

Each is a :class:`~shampoo_conformance.thirdparty.registry.Deviation`
(docs/third-party.md has the measured sizes and, for defects, the upstream
reproductions). Two kinds of difference are listed:

- rules the port reads differently from Google's ``distributed_shampoo``, whose
  arguments it takes by the same names: the backend's importer
  (:func:`.pytorch_optimizer_kwargs.from_kwargs`) maps them, so no config run
  through the backend shows them (``config=None``) and
  ``conformance/tests/test_adapter_pytorch_optimizer.py`` demonstrates each by
  running the library against the reference on Google's reading of the same
  arguments (:func:`.pytorch_optimizer_kwargs.google_kwargs`);
- what a user's run shows (``library_run``): the suite's side-effect
  properties (``tests``) and the adapter tests.

:func:`.pytorch_optimizer.configs` draws none of them. Also the ``maximize``
and unknown-argument deviations of pytorch-optimizer's other optimizers
(:func:`grad_negated_by_maximize`, :func:`unknown_arguments_swallowed`) are
built here.
"""

from __future__ import annotations

from shampoo_conformance.thirdparty.pytorch_optimizer_kwargs import SRC, case
from shampoo_conformance.thirdparty.registry import Deviation

_SHAMPOO = f"{SRC}/shampoo.py"
_PRECONDITIONER = f"{SRC}/utils/preconditioner.py"
_MATRIX = f"{SRC}/utils/matrix.py"


def unknown_arguments_swallowed(optimizer: str, where: str) -> Deviation:
    """``optimizer``'s constructor takes ``**kwargs`` (at ``where``) and ignores them."""
    return Deviation(
        name="unknown_arguments_swallowed",
        config=None,
        tests=("test_side_effect_unknown_argument_refused",),
        cause=(f"{optimizer}.__init__ takes **kwargs ({where}) and reads none of them: a "
               "misspelt or unknown argument (not_an_argument=1.0, or another optimizer's "
               "name for one of its own) is accepted and silently ignored, so the run uses "
               "the default instead"),
        kind="defect",
    )


def grad_negated_by_maximize(optimizer: str, where: str) -> Deviation:
    """``maximize=True`` negates the caller's ``p.grad`` in place (at ``where``)."""
    return Deviation(
        name="grad_negated_by_maximize",
        config=None,
        tests=(),
        cause=(f"with maximize=True {optimizer}.step negates p.grad in place "
               f"(BaseOptimizer.maximize_gradient, pytorch_optimizer/base/optimizer.py:710-713, "
               f"called on p.grad at {where}): after the step the caller's gradient has the "
               "other sign (a second step() on the same gradients, gradient accumulation or "
               "logging sees -g); maximize is off in USER_KWARGS, so the suite's "
               "grads property passes and the adapter tests demonstrate it"),
        kind="defect",
    )


#: Where ScalableShampoo as shipped differs from the spec.
DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="merge_small_dims",
        config=case(shape_interpretation=True, block_size=8),
        tests=(),
        cause=(f"shape_interpretation (on by default) merges dims by its own rule "
               f"({SRC}/utils/shape.py:18-29), not Google's merge_small_dims: a shape whose "
               "dims all fit in block_size becomes [1] and is not preconditioned at all (so "
               "is every vector, and (1, 5, 1); at the default block_size=512 a (7, 10) "
               "parameter is never preconditioned: plain SGD with momentum), a leading dim "
               "> block_size gets an extra 1 x 1 factor, size-1 dims after a large one are "
               f"kept, and the exponent counts those extra dims ({_PRECONDITIONER}:51-64)"),
        kind="defect",
    ),
    Deviation(
        name="one_sided_blocks_crash",
        config=case(pre_conditioner_type=1, matrix_eps=1e-3),
        tests=(),
        cause=("with pre_conditioner_type INPUT or OUTPUT, blocks whose preconditioned dims "
               "have equal sizes but whose other dims differ (a (7, 10) parameter in blocks "
               f"(7, 8) and (7, 2) under INPUT) take the stacked path ({_PRECONDITIONER}:79-84) "
               "and torch.stack of their unfolded gradients raises RuntimeError (:114-121): "
               "the step fails (the demonstration checks that it still raises)"),
        kind="defect",
    ),
    Deviation(
        name="start_step_counted_from_one",
        config=None,
        tests=(),
        cause=(f"Shampoo replaces the graft from step >= start_preconditioning_step on its "
               f"1-based step ({_SHAMPOO}:293-294, :305), Google's distributed_shampoo, whose "
               "argument it ports, from count >= start on a 0-based count: the same argument "
               "starts preconditioning one step earlier than Google's (its step s, Google's "
               "s + 1); the importer maps it (spec start = s, Google's s + 1)"),
        kind="design",
    ),
    Deviation(
        name="one_based_root_schedule",
        config=None,
        tests=(),
        cause=(f"statistics and roots at step % f == 0 on the 1-based step "
               f"({_SHAMPOO}:305, :327-330), whatever the start step; Google's at count % f "
               "== 0 on a 0-based count, so at the first step: eq. (8) with "
               "period_anchor='end', not Google's 'start'. At its defaults "
               "(preconditioning_compute_steps=1000) the first roots come at step 1000, so "
               "steps 25-999 precondition with the identity (the grafted gradient)"),
        kind="design",
    ),
    Deviation(
        name="svd_without_epsilon",
        config=None,
        tests=(),
        cause=(f"use_svd=True takes the inverse root by SVD with no epsilon at all "
               f"({_MATRIX}:268-282, called at {_PRECONDITIONER}:136-143): matrix_eps enters only "
               "the initial statistics matrix_eps I, which decays by beta2^t (beta2 < 1 is "
               "required), so a rank-deficient factor's small eigenvalues get roots of "
               "(1e-6 * 0.999^t)^(-1/p); the importer refuses use_svd (no placement of "
               "eqs. 9-10 says that)"),
        kind="defect",
    ),
    Deviation(
        name="vectors_never_preconditioned",
        config=None,
        tests=(),
        cause=(f"a parameter whose (merged) shape has one dim gets no preconditioner "
               f"({_PRECONDITIONER}:64, len(transformed_shape) > 1), whatever "
               "skip_preconditioning_rank_lt says; Google's preconditions vectors (its "
               "default skip_preconditioning_rank_lt=1): the importer maps "
               "shape_interpretation=False to blocking.skip_rank_lt >= 2"),
        kind="design",
    ),
    Deviation(
        name="skip_rank_lt_below_two_ignored",
        config=None,
        tests=(),
        cause=(f"skip_preconditioning_rank_lt ('skip preconditioning for tensors with rank "
               f"less than this', {_PRECONDITIONER}:16, :96-99; default 1) accepts 0 and 1 but "
               f"rank-1 tensors are skipped anyway (:64): 0 and 1 act as 2, silently (the "
               "importer maps them to 2)"),
        kind="defect",
    ),
    Deviation(
        name="global_rng_draws",
        config=None,
        tests=(),
        cause=(f"each root step starts its power iteration (lambda_max for the ridge) from "
               f"torch.randn of torch's global generator ({_MATRIX}:102, via :227), so a "
               "step consumes the user's random stream (dropout, data order) and the "
               "trajectory changes from run to run (up to 2.0e-6 relative on the named "
               "problem); USER_KWARGS computes its first roots at step 1000, so the suite's "
               "short runs do not see it and the adapter tests demonstrate it"),
        kind="defect",
    ),
    unknown_arguments_swallowed("ScalableShampoo", f"{_SHAMPOO}:217"),
    grad_negated_by_maximize("ScalableShampoo", f"{_SHAMPOO}:318-320"),
)
