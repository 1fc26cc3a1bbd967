"""Bad arguments raise ValueError naming the argument and what is allowed."""

from __future__ import annotations

import inspect

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


def _int_options(name: str) -> list[str]:
    from shampoo_datasets.registry import _builder

    signature = inspect.signature(_builder(name))
    return [
        p.name
        for p in signature.parameters.values()
        if p.name != "seed" and isinstance(p.default, int) and not isinstance(p.default, bool)
    ]


_INT_OPTIONS = [(name, option) for name in PROBLEMS for option in _int_options(name)]


def test_every_size_option_is_covered() -> None:
    assert set(_INT_OPTIONS) >= {
        ("ill_conditioned_least_squares", "rows"),
        ("digits_mlp", "hidden"),
        ("markov_transformer", "vocab_size"),
        ("markov_transformer", "sequence_length"),
        ("markov_transformer", "num_sequences"),
        ("markov_transformer", "d_model"),
        ("markov_transformer", "heads"),
        ("markov_transformer", "layers"),
        ("markov_transformer", "order"),
        ("markov_transformer", "branching"),
    }


@pytest.mark.parametrize(("name", "option"), _INT_OPTIONS)
@pytest.mark.parametrize("value", [0, -1, 2.0, True, "3", None])
def test_every_size_option_rejects_non_positive_or_non_int(
    name: str, option: str, value: object
) -> None:
    with pytest.raises(ValueError, match=f"{option} must be an int >= 1, got {value!r}"):
        load_problem(name, **{option: value})


@pytest.mark.parametrize(
    ("name", "option", "value", "message"),
    [
        ("digits_softmax", "init_scale", -0.1, "init_scale must be a finite real number >= 0"),
        ("diabetes_least_squares", "init_scale", float("nan"), "init_scale must be a finite"),
        ("breast_cancer_logistic", "init_scale", "0.1", "init_scale must be a finite"),
        ("breast_cancer_logistic", "l2", 0.0, "l2 must be a finite real number > 0"),
        ("breast_cancer_logistic", "l2", -1e-3, "l2 must be a finite real number > 0"),
        ("breast_cancer_logistic", "l2", float("inf"), "l2 must be a finite real number > 0"),
        ("breast_cancer_logistic", "l2", True, "l2 must be a finite real number > 0"),
    ],
)
def test_bad_real_options(name: str, option: str, value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_problem(name, **{option: value})


def test_heads_must_divide_d_model_and_the_divisors_are_listed() -> None:
    with pytest.raises(
        ValueError,
        match=r"heads must divide d_model = 12, got heads = 5; allowed: 1, 2, 3, 4, 6, 12",
    ):
        load_problem("markov_transformer", d_model=12, heads=5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"vocab_size": 1}, r"vocab_size must be an int >= 2, got 1"),
        ({"vocab_size": 4, "branching": 5}, r"branching must be an int in \[1, vocab_size = 4\]"),
        ({"order": 2, "sequence_length": 2}, r"sequence_length must be an int > order = 2"),
        ({"vocab_size": 33, "order": 2}, r"vocab_size \*\* order must be <= 1024.*33\*\*2 = 1089"),
    ],
)
def test_markov_transformer_consistency_checks(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_problem("markov_transformer", **options)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("diabetes_least_squares", {"w": np.zeros(10)}, r"params has names \['w'\], expected"),
        ("breast_cancer_logistic", {"w": np.zeros(30), "b": np.zeros(2)}, r"params\['b'\]"),
        ("digits_mlp", {"W1": np.zeros((64, 32))}, r"params has names \['W1'\]"),
        ("markov_transformer", {}, r"params has names \[\], expected"),
    ],
)
def test_params_of_the_wrong_names_or_shapes(
    name: str, params: dict[str, np.ndarray], message: str
) -> None:
    problem = load_problem(name)
    with pytest.raises(ValueError, match=message):
        problem.grad(params)
    with pytest.raises(ValueError, match=message):
        problem.loss(params)
