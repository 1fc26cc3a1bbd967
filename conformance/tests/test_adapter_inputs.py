"""check_run_inputs: the shared input errors of every backend's run (the backend contract)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from shampoo_conformance.adapters.inputs import (
    RUN_DTYPES,
    STEPPER_OPTIMIZERS,
    check_run_inputs,
    check_stepper_arguments,
)


@dataclass
class _Array:
    """Anything with a shape, as the check reads nothing else."""

    shape: tuple[int, ...]


PARAMS = {"w": _Array((2, 3)), "s": 0.5}


def test_matching_inputs_pass() -> None:
    grads = [{"w": _Array((2, 3)), "s": 1.0}, {"s": _Array(()), "w": _Array((2, 3))}]
    for dtype in RUN_DTYPES:
        check_run_inputs("x", PARAMS, grads, dtype)


def test_dtype_outside_the_allowed_set() -> None:
    with pytest.raises(ValueError, match=r"dtype = float16 is invalid for the x backend: "
                                         r"allowed float32, float64"):
        check_run_inputs("x", PARAMS, [], "float16")


def test_missing_or_extra_names_name_the_step() -> None:
    with pytest.raises(ValueError, match=r"grads of step 2 have keys \['w'\]; "
                                         r"the parameters are \['s', 'w'\]"):
        check_run_inputs("x", PARAMS, [{"w": _Array((2, 3)), "s": 1.0}, {"w": _Array((2, 3))}],
                         "float64")


def test_wrong_shape_names_parameter_step_and_shapes() -> None:
    with pytest.raises(ValueError, match=r"gradient of 'w' at step 1 has shape \(3, 2\), "
                                         r"parameter has \(2, 3\)"):
        check_run_inputs("x", PARAMS, [{"w": _Array((3, 2)), "s": 1.0}], "float64")


@pytest.mark.parametrize(
    ("optimizer", "config", "weight_decay", "match"),
    [
        ("sgd", None, 0.0, "optimizer = 'sgd' is invalid: allowed one of"),
        ("shampoo", None, 0.1, "weight_decay = 0.1 is invalid for 'shampoo'"),
        ("adamw", object(), 0.0, "config is invalid for 'adamw'"),
    ],
)
def test_stepper_arguments_rejected(
    optimizer: str, config: object, weight_decay: float, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_stepper_arguments(optimizer, config, weight_decay)


def test_stepper_arguments_accepted() -> None:
    assert STEPPER_OPTIMIZERS == ("shampoo", "adamw")
    check_stepper_arguments("shampoo", None, 0.0)
    check_stepper_arguments("adamw", None, 0.1)
