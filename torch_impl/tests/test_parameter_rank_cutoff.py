"""Eq. (10g), a parameter's rank cutoff (``epsilon.rank_cutoff_scope="parameter"``):
the torch optimizer against the float64 reference, and distributed against one process.

The streams give a parameter blocks of very different scales, so a cutoff
scaled by the parameter's largest eigenvalue (eq. 10g) drops whole blocks
that eq. (10)'s own cutoffs keep; every case also asserts that the two scopes
differ on its data, so a backend that ignored the scope would fail.

- ``w`` (12, 3) in three row blocks of (4, 3), the third scaled by 1e-4 (its
  eigenvalues about 1e-8 of the others', every one at least a factor 10 from
  the cutoff 1e-6 Lambda_k: no decision is left to rounding).
- ``x`` (8, 3) and ``y`` (4, 3), scaled by 1e-3 and 1e-4: their blocks share the
  (4, 3) block group with ``w``'s, so a max taken over the batch instead of
  over each parameter would drop them; they must keep their directions.
- eq. (3): a NaN in ``w``'s large block at a root step skips that block, which
  then takes no part in Lambda_k; the small blocks' own max keeps them that step.

Tolerance (float64): ``max_relative_error <= 1e-9``, as the torch-vs-reference
cases of ``test_reference_equality.py``; measured about 1e-14. Distributed
(gloo, world size 2, a parameter's large and small blocks on different ranks): bit for bit equal to
one process, as ``test_distributed.py`` requires.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shampoo_spec as ss
from shampoo_conformance.adapters.torch import run as torch_run
from shampoo_conformance.suite.rank_cutoff_problems import diagonal_stream, tearfree_shampoo
from shampoo_reference import run as reference_run

from .helpers import max_relative_error, spawn_ok

FLOAT64_RTOL = 1e-9
SCENARIOS = str(Path(__file__).with_name("parameter_rank_cutoff_scenarios.py"))


def _config(scope: str, precondition_frequency: int = 1, lagged: bool = False,
            **changes: Any) -> ss.ShampooConfig:
    return tearfree_shampoo(scope, precondition_frequency=precondition_frequency,  # type: ignore[arg-type]
                            roots_take_effect="next_step" if lagged else "same_step", **changes)


def _stream(steps: int = 4, seed: int = 7, rows: int = 12
            ) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """w (rows, 3), its last block of 4 rows scaled by 1e-4; x and y as the module says."""
    rng = np.random.default_rng(seed)
    grads = []
    for _ in range(steps):
        g = {"w": rng.standard_normal((rows, 3)), "x": 1e-3 * rng.standard_normal((8, 3)),
             "y": 1e-4 * rng.standard_normal((4, 3))}
        g["w"][rows - 4:] *= 1e-4
        grads.append(g)
    return {k: np.zeros(v.shape) for k, v in grads[0].items()}, grads


def _both(config: ss.ShampooConfig, params: dict[str, np.ndarray],
          grads: list[dict[str, np.ndarray]]) -> tuple[list[dict], list[dict]]:
    return torch_run(config, params, grads), reference_run(config, params, grads)


def _last_directions(path: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The last step's direction (learning rate 1, no momentum: minus the update)."""
    return {k: path[-2][k] - path[-1][k] for k in path[-1]}


def test_diagonal_blocks_drop_what_the_factor_scope_keeps() -> None:
    """A vector in two blocks summing to diag(1e4, ...) and diag(1, 1, 1, 1e-5). The
    last step's gradient is sqrt(1e-5) on entry 7, whose eigenvalue is 1e-5:
    (1e-5)^(-1/2) sqrt(1e-5) = 1 kept (eq. 10), 0 dropped (1e-5 <= 1e-6 * 1e4, eq. 10g)."""
    grads = [{"v": g} for g in diagonal_stream()]
    params = {"v": np.zeros(8)}
    for scope, want in (("factor", 1.0), ("parameter", 0.0)):
        ours, ref = _both(_config(scope), params, grads)
        assert max_relative_error(params, ours, ref) <= FLOAT64_RTOL, scope
        got = _last_directions(ours)["v"][7]
        assert got == pytest.approx(want, rel=1e-12, abs=0.0), scope


#: Eq. (7): an exponential average, bias corrected (A = L / (1 - beta2^n)).
DECAYED = {"statistics": ss.StatisticsConfig(beta2=0.9, bias_correction=True)}


@pytest.mark.parametrize("precondition_frequency, lagged, changes",
                         [(1, False, {}), (2, False, {}), (1, True, {}), (2, False, DECAYED)])
def test_equal_to_reference_on_blocks_of_different_scales(
        precondition_frequency: int, lagged: bool, changes: dict[str, Any]) -> None:
    params, grads = _stream(steps=6)
    shared = _config("parameter", precondition_frequency, lagged, **changes)
    ours, ref = _both(shared, params, grads)
    error = max_relative_error(params, ours, ref)
    assert error <= FLOAT64_RTOL, error
    own, own_ref = _both(_config("factor", precondition_frequency, lagged, **changes),
                         params, grads)
    assert max_relative_error(params, own, own_ref) <= FLOAT64_RTOL
    mine, theirs = _last_directions(ours), _last_directions(own)
    # w's small block: dropped by the parameter's cutoff, kept by its own.
    assert np.abs(mine["w"][8:]).max() == 0.0
    assert np.abs(theirs["w"][8:]).max() > 1e-3
    # x and y share w's block group: their cutoffs scale by their own eigenvalues,
    # never w's (a max over the batch would drop them as it drops w's small block).
    for name in ("x", "y"):
        assert np.abs(mine[name]).max() > 1e-3, name
        np.testing.assert_allclose(mine[name], theirs[name], rtol=1e-9, atol=0.0)


def test_a_skipped_block_takes_no_part() -> None:
    """Eq. (3) skips w's large block at step 3 (a NaN): Lambda_k is then the small
    blocks' own max, which keeps their directions on that step only."""
    rng = np.random.default_rng(11)
    grads = []
    for _ in range(4):
        g = 1e-4 * rng.standard_normal((12, 3))
        g[:4] *= 1e4
        grads.append({"w": g})
    grads[2]["w"][0, 0] = np.nan
    params = {"w": np.zeros((12, 3))}
    config = _config("parameter",
                     failure=ss.FailureConfig(nonfinite_gradient="skip_block"))
    ours, ref = _both(config, params, grads)
    error = max_relative_error(params, ours, ref)
    assert error <= FLOAT64_RTOL, error
    steps = [params["w"] - params["w"]] + [p["w"] for p in ours]
    small = [np.abs(steps[t] - steps[t + 1])[4:].max() for t in range(4)]
    assert small[2] > 1e-3 and small[3] == 0.0 and small[1] == 0.0, small


def test_one_block_parameters_do_not_see_the_scope() -> None:
    rng = np.random.default_rng(3)
    grads = [{"w": rng.standard_normal((4, 3))} for _ in range(3)]
    params = {"w": np.zeros((4, 3))}
    own = torch_run(_config("factor"), params, grads)
    shared = torch_run(_config("parameter"), params, grads)
    for a, b in zip(own, shared, strict=True):
        np.testing.assert_array_equal(a["w"], b["w"])


@cache
def _distributed() -> list[dict[str, Any]]:
    # w of two blocks, one large and one small: the assignment puts them on different
    # ranks (asserted below), so the small block's Lambda_k comes from the other rank.
    params, grads = _stream(steps=5, rows=8)
    configs = {"parameter": _config("parameter"),
               "parameter_lagged_every_2": _config("parameter", 2, lagged=True),
               "factor": _config("factor")}
    return spawn_ok(f"{SCENARIOS}:compare", 2, (configs, params, grads))


@pytest.mark.parametrize("case", ["parameter", "parameter_lagged_every_2", "factor"])
def test_distributed_equals_one_process_bit_for_bit(case: str) -> None:
    ranks = _distributed()
    for rank, r in enumerate(ranks):
        got = r[case]
        # w's large and small blocks on different ranks: the small one's Lambda_k is
        # the other rank's (a rank that kept its own would not drop it, and differ).
        assert sorted(got["owners"]["w"]) == [0, 1], got["owners"]
        for name, value in got["single"].items():
            np.testing.assert_array_equal(got["distributed"][name], value,
                                          err_msg=f"{case} {name} rank {rank}")
            np.testing.assert_array_equal(got["distributed"][name],
                                          ranks[0][case]["distributed"][name])
    # The scope matters on this data: a rank that kept its own Lambda would differ.
    shared, own = ranks[0]["parameter"]["single"], ranks[0]["factor"]["single"]
    assert not np.array_equal(shared["w"][4:], own["w"][4:])
