"""The shape plan (eqs. 4, 5, 12): blocks tile the tensor, reassembly is the identity."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shampoo_spec as ss

shapes = st.lists(st.integers(1, 9), min_size=0, max_size=4).map(tuple)


def _config(block: int, merge: int | None, direction: str) -> ss.ShampooConfig:
    return ss.ShampooConfig(
        blocking=ss.BlockingConfig(
            max_preconditioner_dim=block, merge_dims_up_to=merge, merge_direction=direction
        )
    )


@given(
    shape=shapes,
    block=st.integers(1, 10),
    merge=st.one_of(st.none(), st.integers(1, 100)),
    direction=st.sampled_from(["last_to_first", "first_to_last"]),
)
def test_blocks_tile_the_tensor_exactly(
    shape: tuple[int, ...], block: int, merge: int | None, direction: str
) -> None:
    plan = ss.plan_parameter(shape, _config(block, merge, direction))
    assert math.prod(plan.merged_shape) == math.prod(shape)
    cover = np.zeros(plan.merged_shape, dtype=int)
    for b in plan.blocks:
        assert all(1 <= n <= block for n in b.shape)
        cover[b.slices] += 1
    assert (cover == 1).all()
    # Reassembly: cutting a tensor into blocks and writing them back is the identity.
    x = np.arange(math.prod(shape), dtype=float).reshape(shape)
    merged = x.reshape(plan.merged_shape)
    rebuilt = np.empty_like(merged)
    for b in plan.blocks:
        rebuilt[b.slices] = merged[b.slices]
    np.testing.assert_array_equal(rebuilt.reshape(shape), x)
    # Blocks come in row-major order of their offsets.
    assert [b.offsets for b in plan.blocks] == sorted(b.offsets for b in plan.blocks)


@given(shape=shapes, merge=st.integers(1, 200))
def test_merged_dims_respect_the_threshold(shape: tuple[int, ...], merge: int) -> None:
    for direction in ("last_to_first", "first_to_last"):
        merged = ss.merge_dims(ss.squeeze_shape(shape), merge, direction)
        assert math.prod(merged) == math.prod(shape)
        # No two adjacent dims could have been merged further... unless one alone exceeds it.
        for a, b in zip(merged, merged[1:], strict=False):
            assert a * b > merge


@pytest.mark.parametrize(
    ("shape", "up_to", "direction", "expected"),
    [
        ((10, 7), 4096, "first_to_last", (70,)),
        ((3, 4, 5), 4096, "first_to_last", (60,)),
        ((40, 100, 40), 4096, "first_to_last", (4000, 40)),
        ((40, 100, 40), 4096, "last_to_first", (40, 4000)),
        ((1, 7, 1, 10), 1024, "last_to_first", (70,)),
        ((), 1024, "last_to_first", (1,)),
        ((1, 1), 1024, "last_to_first", (1,)),
        ((7, 10), None, "last_to_first", (7, 10)),
    ],
)
def test_merge_examples(
    shape: tuple[int, ...], up_to: int | None, direction: str, expected: tuple[int, ...]
) -> None:
    assert ss.merge_dims(ss.squeeze_shape(shape), up_to, direction) == expected


def test_blocking_splits_remainder_last_in_row_major_order() -> None:
    plan = ss.plan_parameter((5, 3), _config(2, None, "last_to_first"))
    assert [b.offsets for b in plan.blocks] == [(0, 0), (0, 2), (2, 0), (2, 2), (4, 0), (4, 2)]
    assert [b.shape for b in plan.blocks] == [(2, 2), (2, 1), (2, 2), (2, 1), (1, 2), (1, 1)]


def test_default_roots_are_twice_the_block_order() -> None:
    c = _config(1024, None, "last_to_first")
    assert ss.plan_parameter((7, 10), c).blocks[0].roots == (4.0, 4.0)
    assert ss.plan_parameter((7,), c).blocks[0].roots == (2.0,)
    assert ss.plan_parameter((), c).blocks[0].roots == (2.0,)
    assert ss.plan_parameter((2, 3, 4), c).blocks[0].roots == (6.0, 6.0, 6.0)


def test_exponent_overrides_and_one_sided() -> None:
    over = ss.ShampooConfig(
        blocking=ss.BlockingConfig(merge_dims_up_to=None),
        exponents=ss.ExponentConfig(
            overrides_by_order=(ss.OrderOverride(order=2, roots=(2.0, 0.0)),)
        ),
    )
    assert ss.plan_parameter((7, 10), over).blocks[0].roots == (2.0, 0.0)
    assert ss.plan_parameter((7, 10, 3), over).blocks[0].roots == (6.0, 6.0, 6.0)
    google_like = ss.ShampooConfig(
        blocking=ss.BlockingConfig(merge_dims_up_to=None, preconditioned_dims="all_but_last"),
        exponents=ss.ExponentConfig(default="preconditioned_dims"),
    )
    assert ss.plan_parameter((7, 10), google_like).blocks[0].roots == (2.0, 0.0)
    assert ss.plan_parameter((7,), google_like).blocks[0].roots == (2.0,)
    fixed = ss.ShampooConfig(exponents=ss.ExponentConfig(override=4.0))
    assert ss.plan_parameter((7,), fixed).blocks[0].roots == (4.0,)


def test_skip_rules() -> None:
    c = ss.ShampooConfig(blocking=ss.BlockingConfig(skip_dim_size_gt=8, skip_rank_lt=1))
    assert not ss.plan_parameter((9, 2), c).preconditioned
    assert not ss.plan_parameter((), c).preconditioned
    assert ss.plan_parameter((8, 2), c).preconditioned
    skipped = ss.plan_parameter((9, 2), c)
    assert skipped.blocks[0].roots == (0.0,) * len(skipped.merged_shape)


def test_without_squeeze_size_one_dims_stay_and_count_in_the_roots() -> None:
    """Eq. (4) with ``squeeze=False`` (Google's best_effort_shape_interpretation=False)."""
    c = ss.ShampooConfig(
        blocking=ss.BlockingConfig(squeeze=False, merge_dims_up_to=None, max_preconditioner_dim=4),
        exponents=ss.ExponentConfig(default="preconditioned_dims"),
    )
    p = ss.plan_parameter((1, 5, 1), c)
    assert p.merged_shape == (1, 5, 1) and p.preconditioned
    assert [b.shape for b in p.blocks] == [(1, 4, 1), (1, 1, 1)]
    assert all(b.roots == (6.0, 6.0, 6.0) for b in p.blocks)  # 2 * three preconditioned dims
    squeezed = ss.plan_parameter((1, 5, 1), dataclasses.replace(
        c, blocking=dataclasses.replace(c.blocking, squeeze=True)))
    assert squeezed.merged_shape == (5,) and squeezed.blocks[0].roots == (2.0,)
    scalar = ss.plan_parameter((), c)  # a (1,) block with a 1 x 1 factor, root 2 * 1
    assert scalar.preconditioned and [b.roots for b in scalar.blocks] == [(2.0,)]
    bare = dataclasses.replace(c, blocking=dataclasses.replace(c.blocking, scalar_factor=False))
    no_factor = ss.plan_parameter((), bare)  # no dim, no factor: P = F
    assert no_factor.preconditioned and no_factor.merged_shape == (1,)
    assert [b.roots for b in no_factor.blocks] == [(0.0,)]
    assert ss.plan_parameter((1,), bare).blocks[0].roots == (2.0,)  # only 0-d loses it
    # Merging absorbs size-1 dims while the product fits: (1, 5, 1) -> (5,).
    merged = dataclasses.replace(c, blocking=dataclasses.replace(c.blocking, merge_dims_up_to=8))
    assert ss.plan_parameter((1, 5, 1), merged).merged_shape == (5,)
    assert ss.plan_parameter((1, 9), merged).merged_shape == (1, 9)


def test_negative_dims_are_rejected() -> None:
    with pytest.raises(ValueError, match="shape"):
        ss.plan_parameter((3, -1), ss.ShampooConfig())


@pytest.mark.parametrize(
    ("shape", "up_to", "target", "expected"),
    [
        # Meta's merge_small_dims examples (target_parameter_dimensionality).
        ((1, 2, 5, 1), 10, 1, (10,)),
        ((1, 2, 5, 1), 1, 1, (2, 5)),
        ((32, 3, 64, 64), 8192, 1, (96, 4096)),
        ((32, 3, 64, 64), 1_000_000, 2, (32, 12_288)),
        ((32, 3, 64, 64), 1_000_000, 4, (32, 3, 64, 64)),
        ((4, 4, 4), 64, 2, (4, 16)),
    ],
)
def test_merge_stops_at_the_target_rank(
    shape: tuple[int, ...], up_to: int, target: int, expected: tuple[int, ...]
) -> None:
    assert ss.merge_dims(ss.squeeze_shape(shape), up_to, "last_to_first", target) == expected
