"""Bad arguments raise ValueError naming the argument and what is allowed."""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_datasets import PROBLEMS, load_problem, problem_options


@pytest.mark.parametrize("name", ["mnist", "", "Digits_Softmax", None, 3])
def test_unknown_name_lists_valid_names(name: object) -> None:
    with pytest.raises(ValueError, match="name must be one of") as info:
        load_problem(name)  # type: ignore[arg-type]
    for valid in PROBLEMS:
        assert valid in str(info.value)


@pytest.mark.parametrize("name", PROBLEMS)
@pytest.mark.parametrize("seed", [1.0, "1", True, -1, None])
def test_bad_seed(name: str, seed: object) -> None:
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        load_problem(name, seed=seed)  # type: ignore[arg-type]


def test_numpy_integer_seed_is_accepted() -> None:
    a = load_problem("ill_conditioned_least_squares", seed=np.int64(5))
    b = load_problem("ill_conditioned_least_squares", seed=5)
    np.testing.assert_array_equal(a.data["A"], b.data["A"])


@pytest.mark.parametrize("argument", ["rows", "cols"])
@pytest.mark.parametrize("value", [0, -2, 2.0, True, "3"])
def test_bad_sizes(argument: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"{argument} must be an int >= 1"):
        load_problem("ill_conditioned_least_squares", **{argument: value})


@pytest.mark.parametrize("value", [0.5, -1.0, float("inf"), float("nan"), "10"])
def test_bad_condition_number(value: object) -> None:
    with pytest.raises(ValueError, match="condition_number must be a finite real number >= 1"):
        load_problem("ill_conditioned_least_squares", condition_number=value)


def test_one_by_one_problem_needs_condition_number_one() -> None:
    with pytest.raises(ValueError, match="condition_number must be 1"):
        load_problem("ill_conditioned_least_squares", rows=1, cols=1, condition_number=10.0)
    load_problem("ill_conditioned_least_squares", rows=1, cols=1, condition_number=1.0)


def test_unknown_option_lists_allowed_options() -> None:
    with pytest.raises(ValueError, match="'size' is not an option") as info:
        load_problem("ill_conditioned_least_squares", size=3)
    for option in problem_options("ill_conditioned_least_squares"):
        assert option in str(info.value)
    with pytest.raises(ValueError, match="'rows' is not an option of problem 'digits_softmax'"):
        load_problem("digits_softmax", rows=3)


def test_bad_init_scale() -> None:
    with pytest.raises(ValueError, match="init_scale must be a finite real number >= 0"):
        load_problem("digits_softmax", init_scale=-0.1)


def test_params_with_wrong_names_or_shapes() -> None:
    problem = load_problem("ill_conditioned_least_squares", rows=3, cols=2)
    with pytest.raises(ValueError, match=r"params has names \['Y'\], expected \['X'\]"):
        problem.loss({"Y": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"params\['X'\] has shape \(2, 3\), expected \(3, 2\)"):
        problem.grad({"X": np.zeros((2, 3))})
