"""JSON round trip of the config, and clear errors for malformed dicts."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import shampoo_spec as ss

configs = st.builds(
    ss.ShampooConfig,
    learning_rate=st.floats(0, 10),
    statistics=st.builds(
        ss.StatisticsConfig,
        beta2=st.sampled_from([1.0, 0.999, 0.5]),
        bias_correction=st.booleans(),
        initial_value=st.sampled_from(["zero", "epsilon_identity"]),
    ),
    epsilon=st.builds(
        ss.EpsilonConfig,
        value=st.floats(0, 1, allow_subnormal=False).filter(lambda x: x == 0 or x >= 2.0**-126),
        scale=st.sampled_from(["absolute", "relative"]),
        placement=st.sampled_from(["ridge", "shift_after", "floor"]),
    ),
    root_inverse=st.one_of(
        st.builds(ss.EighConfig, failure_threshold=st.one_of(
            st.none(), st.floats(2.0**-126, 1e300), st.sampled_from([0.1, 1e-30]))),
        st.builds(ss.CoupledNewtonConfig, max_iterations=st.integers(1, 200),
                  error_growth_limit=st.one_of(st.none(), st.just(1.2)),
                  retries=st.integers(0, 6)),
    ),
    exponents=st.one_of(
        st.just(ss.ExponentConfig()),
        st.just(ss.ExponentConfig(
            overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0, 0.0)),))),
        st.just(ss.ExponentConfig(default="preconditioned_dims", override=4.0)),
    ),
    grafting=st.sampled_from([
        ss.GraftingConfig(),
        ss.GraftingConfig(type="adagrad", norm_scope="parameter"),
        ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
    ]),
    momentum=st.one_of(
        st.builds(ss.MomentumConfig, momentum=st.sampled_from([0.0, 0.9]),
                  nesterov=st.booleans()),
        st.builds(ss.MomentumConfig, momentum=st.just(0.9), storage=st.just("int8_columnwise"),
                  scale_dtype=st.sampled_from(["float32", "float64"])),
    ),
    schedule=st.builds(ss.ScheduleConfig, precondition_frequency=st.integers(1, 100),
                       start_preconditioning_step=st.one_of(st.none(), st.integers(1, 100))),
    factor_dtype=st.sampled_from(["float32", "float64"]),
    inverse_root_dtype=st.one_of(st.none(), st.sampled_from(ss.INVERSE_ROOT_DTYPES)),
    update_dtype=st.one_of(st.none(), st.sampled_from(ss.UPDATE_DTYPES)),
)


@given(configs)
def test_json_round_trip(config: ss.ShampooConfig) -> None:
    text = json.dumps(config.to_dict())
    assert ss.ShampooConfig.from_dict(json.loads(text)) == config


def test_eigenvalue_correction_round_trip() -> None:
    c = ss.ShampooConfig(eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.95))
    assert ss.ShampooConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("dtype", [None, *ss.INVERSE_ROOT_DTYPES])
def test_inverse_root_dtype_round_trip(dtype: str | None) -> None:
    """Eqs. (11a), (16): the storage dtype of the roots survives JSON; None is written as null."""
    c = ss.ShampooConfig(factor_dtype="float64", inverse_root_dtype=dtype)  # type: ignore[arg-type]
    data = json.loads(json.dumps(c.to_dict()))
    assert data["inverse_root_dtype"] == dtype
    assert ss.ShampooConfig.from_dict(data) == c
    assert c.root_dtype == (dtype or "float64")
    assert c.rounds_inverse_roots is (dtype is not None)


@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_factor_storage_round_trip(scale_dtype: str) -> None:
    """Eq. (20c): int16 factor storage and its scale dtype survive JSON; an older dict
    reads 'float'."""
    c = ss.ShampooConfig(
        statistics=ss.StatisticsConfig(storage="int16_columnwise_diagonal",
                                       scale_dtype=scale_dtype),  # type: ignore[arg-type]
        root_inverse=ss.CoupledNewtonConfig())
    data = json.loads(json.dumps(c.to_dict()))
    assert data["statistics"]["storage"] == "int16_columnwise_diagonal"
    assert data["statistics"]["scale_dtype"] == scale_dtype
    assert ss.ShampooConfig.from_dict(data) == c
    del data["statistics"]["storage"], data["statistics"]["scale_dtype"]
    assert ss.ShampooConfig.from_dict(data).statistics.storage == "float"


@pytest.mark.parametrize("scale_dtype", ["float32", "float64"])
def test_momentum_storage_round_trip(scale_dtype: str) -> None:
    """Eq. (20b): int8 storage and its scale dtype survive JSON; an older dict reads 'float'."""
    c = ss.ShampooConfig(momentum=ss.MomentumConfig(
        momentum=0.9, storage="int8_columnwise", scale_dtype=scale_dtype))  # type: ignore[arg-type]
    data = json.loads(json.dumps(c.to_dict()))
    assert data["momentum"]["storage"] == "int8_columnwise"
    assert data["momentum"]["scale_dtype"] == scale_dtype
    assert ss.ShampooConfig.from_dict(data) == c
    del data["momentum"]["storage"], data["momentum"]["scale_dtype"]
    assert ss.ShampooConfig.from_dict(data).momentum.storage == "float"


@pytest.mark.parametrize("dtype", [None, *ss.INVERSE_ROOT_DTYPES])
def test_eigenvalue_correction_dtypes_round_trip(dtype: str | None) -> None:
    """Eq. (17a): the storage dtypes of Q_k and D survive JSON; None is written as null."""
    ec = ss.EigenvalueCorrectionConfig(
        eigenvectors_dtype=dtype, corrected_eigenvalues_dtype="bfloat16")  # type: ignore[arg-type]
    c = ss.ShampooConfig(factor_dtype="float64", eigenvalue_correction=ec)
    data = json.loads(json.dumps(c.to_dict()))
    assert data["eigenvalue_correction"]["eigenvectors_dtype"] == dtype
    assert data["eigenvalue_correction"]["corrected_eigenvalues_dtype"] == "bfloat16"
    assert ss.ShampooConfig.from_dict(data) == c
    older = json.loads(json.dumps(c.to_dict()))
    del older["eigenvalue_correction"]["eigenvectors_dtype"]
    del older["eigenvalue_correction"]["corrected_eigenvalues_dtype"]
    read = ss.ShampooConfig.from_dict(older).eigenvalue_correction
    assert read is not None
    assert (read.eigenvectors_dtype, read.corrected_eigenvalues_dtype) == (None, None)


@pytest.mark.parametrize("dtype", [None, *ss.FACTOR_STORAGE_DTYPES])
def test_factor_storage_dtype_round_trip(dtype: str | None) -> None:
    """Eq. (11b): the factors' storage dtype survives JSON; a dict without it reads None."""
    c = ss.ShampooConfig(factor_dtype="float64", factor_storage_dtype=dtype,  # type: ignore[arg-type]
                         epsilon=ss.EpsilonConfig(value=1e-4))
    data = json.loads(json.dumps(c.to_dict()))
    assert data["factor_storage_dtype"] == dtype
    assert ss.ShampooConfig.from_dict(data) == c
    del data["factor_storage_dtype"]
    assert ss.ShampooConfig.from_dict(data).factor_storage_dtype is None


def test_dict_without_inverse_root_dtype_reads_none() -> None:
    """A dict saved before the field existed (checkpoints) reads as None: today's numerics."""
    data = ss.ShampooConfig(factor_dtype="float64").to_dict()
    del data["inverse_root_dtype"]
    assert ss.ShampooConfig.from_dict(data).inverse_root_dtype is None


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"learnign_rate": 0.1}, "learnign_rate"),
        ({"grafting": {"typ": "adagrad"}}, "typ"),
        ({"root_inverse": {"method": "lobpcg"}}, "lobpcg"),
        ({"grafting": "adagrad"}, "grafting"),
        ({"exponents": {"overrides_by_order": 4}}, "overrides_by_order"),
        ({"inverse_root_dtype": "float8"}, "inverse_root_dtype"),
        ({"factor_storage_dtype": "float8"}, "factor_storage_dtype"),
        ({"eigenvalue_correction": {"eigenvectors_dtype": "float8"}}, "eigenvectors_dtype"),
        ({"eigenvalue_correction": {"corrected_eigenvalues_dtype": "int8"}},
         "corrected_eigenvalues_dtype"),
    ],
)
def test_malformed_dicts_raise_naming_the_key(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ss.ShampooConfig.from_dict(data)
