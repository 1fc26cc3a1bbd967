"""The ``meta`` backend: Meta's ``DistributedShampoo`` run as its users run it.

Meta's library (facebookresearch/optimizers, package ``torch-shampoo``,
import ``distributed_shampoo``) is driven from ``to_meta(config)``: the
kwargs Meta takes for the same Shampoo, turned into its real config
classes. Nothing of Meta's is patched and torch's default dtype is left as
the user has it (float32), so the suite measures the library as shipped;
where its numerics differ from the spec, docs/third-party.md says why
(:data:`DEVIATIONS` marks those properties as expected failures).

Capabilities: a config Meta's arguments cannot express (Google's coupled
Newton rules, relative epsilon, per-parameter graft norms, ...) raises
:class:`~shampoo_spec.Inexpressible` naming the fields, and
:func:`configs` draws only configs Meta expresses (its own kwargs, imported).
Runs float64 and float32 parameters on one CPU process (its DDP
``communication_dtype`` needs a process group: refused here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from distributed_shampoo import DistributedShampoo, shampoo_types
from distributed_shampoo.preconditioner import matrix_functions_types
from hypothesis import strategies as st

from shampoo_conformance.adapters.torch import Stepper
from shampoo_conformance.adapters.torch_user_run import torch_library_run
from shampoo_conformance.thirdparty.anchor_cases import META_CASES
from shampoo_conformance.thirdparty.registry import Deviation, LibraryRun
from shampoo_conformance.thirdparty.torch_library import in_dtype, make_stepper, run_optimizer
from shampoo_spec import Inexpressible, ShampooConfig, from_meta, to_meta

#: Parameter dtypes this backend runs (factors in the same precision).
dtypes = (np.float64, np.float32)

#: Where Meta's library lives, for the pointers below (commit f606606).
_SRC = "distributed_shampoo/distributed_shampoo.py"
_PRECOND = "distributed_shampoo/preconditioner"


def _config(**kwargs: Any) -> ShampooConfig:
    """A config from Meta's kwargs (JSON form) over a plain float32-exact base."""
    base = {"lr": 0.125, "max_preconditioner_dim": 8, "epsilon": 1e-3,
            "precondition_frequency": 1, "start_preconditioning_step": 1}
    return from_meta({**base, **kwargs})


#: Where Meta as shipped differs from the spec, with the cause (docs/third-party.md
#: has the measurements and the upstream reproductions). ``configs()`` draws none of
#: the configs these cover; each is demonstrated by its own ``config``.
DEVIATIONS: tuple[Deviation, ...] = (
    Deviation(
        name="float32_learning_rate",
        config=_config(lr=0.1, grafting_config={"type": "SGDPreconditionerConfig"}),
        tests=(),
        cause=(f"the learning rate is a float32 tensor whatever the parameters' dtype "
               f"({_SRC}:826, applied at :1484), so float64 parameters move by "
               "fl32(lr) * direction: relative error up to 2^-24 per step"),
        kind="defect",
    ),
    Deviation(
        name="float32_bias_corrections",
        config=_config(betas=[0.9, 0.999], use_bias_correction=True,
                       grafting_config={"type": "AdamPreconditionerConfig", "beta2": 0.999}),
        tests=("test_library_case_float64[adam_graft_ema]",
               # Eq. (16b)'s law: the filter's correction (beta1 0.9; sign descent
               # does not see a scale) and Adam's 1 - beta2^t.
               *(f"test_diagonal_preconditioner_is_its_first_order_method[*-0.9-{m}]"
                 for m in ("sgd", "adagrad", "rmsprop")),
               "test_diagonal_preconditioner_is_its_first_order_method[*-adam]"),
        cause=("the bias corrections 1 - beta2^t of the factors and of the Adam/RMSprop "
               "grafts are built from torch.tensor(1.0) and the int64 step, so they take "
               f"torch's default dtype (float32) even for float64 parameters "
               f"({_PRECOND}/shampoo_preconditioner_list.py:1421, "
               f"{_PRECOND}/adagrad_preconditioner_list.py:141); the filter's "
               f"1 - beta3 beta1^(t-1) likewise ({_SRC}:1191)"),
        kind="defect",
    ),
    Deviation(
        name="svd_null_vectors",
        # Shown on a rank-deficient gradient, which the drawn streams never are: by the
        # law below and anchors/test_meta_library.py[svd_output_layer].
        config=None,
        tests=("test_spectral_descent_steps_along_the_orthogonalized_gradient[*method='svd'*]",),
        cause=("SVDOrthogonalizationConfig takes U V^T over every singular pair "
               f"({_PRECOND}/matrix_functions.py:947-948); for a rank-deficient block the "
               "pairs of its zero singular values (about 1e-16 s_max after rounding) have "
               "arbitrary singular vectors, which LAPACK picks from rounding, and each adds "
               "a unit-size term to the direction; eq. (16c) keeps the pairs above "
               "max(m, n) eps s_max (the polar factor on the block's range)"),
        kind="defect",
    ),
    Deviation(
        name="inplace_filter_aliasing",
        # Before preconditioning starts the direction is the SGD graft's: the state.
        config=_config(betas=[0.9, 1.0], beta3=-1.0, use_bias_correction=False,
                       grafting_config={"type": "SGDPreconditionerConfig"},
                       start_preconditioning_step=100),
        tests=(),
        cause=("with beta1 > 0, beta3 = beta1 and use_bias_correction=False the filtered "
               f"gradient Meta preconditions is its filter state itself ({_SRC}:1172-1180, "
               "no copy at :1190); the SGD graft returns its input "
               f"({_PRECOND}/sgd_preconditioner_list.py:36-37) and the in-place "
               f"_foreach_mul_(directions, -lr) ({_SRC}:1484) then overwrites the state: "
               "the next filter starts from -lr * F instead of F"),
        kind="defect",
    ),
)

#: Meta's own argument sets (those ``nox -s anchors`` checks on the digits MLP) on
#: the suite's named problem: a float32-exact learning rate, small blocks, and no
#: gradient filter or bias correction where a case does not set them (Meta's
#: defaults, betas (0.9, 1.0) with bias correction, would meet the float32 bias
#: corrections of DEVIATIONS in every case).
CASES: dict[str, ShampooConfig] = {
    name: _config(**{"betas": [0.0, 1.0], "use_bias_correction": False,
                     "start_preconditioning_step": -1,
                     "epsilon": 1e-12, **kwargs})
    for name, kwargs in META_CASES.items()
}

# ------------------------------------------------- JSON form -> Meta's real objects
#: Where Meta defines the config classes the JSON form names by ``"type"``.
_MODULES = (shampoo_types, matrix_functions_types)


def _meta_class(name: str) -> type:
    for module in _MODULES:
        cls = getattr(module, name, None)
        if isinstance(cls, type):
            return cls
    raise LookupError(f"Meta's library has no config class {name!r}")


def _meta_key(key: Any) -> Any:
    """JSON object keys naming an order or a dim are digit strings; Meta's dicts take ints."""
    return int(key) if isinstance(key, str) and key.isdigit() else key


def _meta_value(key: str, value: Any) -> Any:
    """One JSON-form value as Meta takes it: configs, enums by name, dtypes, int-keyed dicts."""
    if isinstance(value, Mapping):
        if "type" in value:
            cls = _meta_class(value["type"])
            fields = {k: _meta_value(k, v) for k, v in value.items() if k != "type"}
            return cls(**fields)
        return {_meta_key(k): _meta_value(str(k), v) for k, v in value.items()}
    if key.endswith("dtype") and isinstance(value, str):
        dtype = getattr(torch, value.removeprefix("torch."))
        assert isinstance(dtype, torch.dtype), value
        return dtype
    if key == "weight_decay_type":
        # "DECOUPLED" or "WeightDecayType.DECOUPLED" (any dotted prefix).
        return shampoo_types.WeightDecayType[value.rpartition(".")[2]]
    if key == "param_assignment_strategy":
        # "REPLICATE" or "FSDPParamAssignmentStrategy.REPLICATE" (any dotted prefix).
        return shampoo_types.FSDPParamAssignmentStrategy[value.rpartition(".")[2]]
    if key == "device_mesh" and isinstance(value, list):
        # HybridShardDistributedConfig's mesh by its shape [replicate, shard]: a new CPU
        # mesh over the joined process group (a DeviceMesh object is passed as it is).
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh("cpu", tuple(value), mesh_dim_names=("replicate", "shard"))
    if key == "betas":
        return tuple(value)
    if key == "target_parameter_dimensionality" and value == "inf":
        return math.inf
    return value


def meta_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``DistributedShampoo``'s keyword arguments from their JSON form (``to_meta``'s)."""
    return {k: _meta_value(k, v) for k, v in kwargs.items()}


# ------------------------------------------------------------------- capabilities
def expressible(config: ShampooConfig, dtype: Any = np.float64) -> str | None:
    """Why Meta cannot run ``config`` with ``dtype`` parameters here, or None if it can."""
    try:
        kwargs = to_meta(in_dtype(config, dtype))
    except Inexpressible as err:
        return str(err)
    kind = kwargs.get("distributed_config", {}).get("type")
    if kind not in (None, "SingleDeviceDistributedConfig"):
        return (f"update_dtype = {config.update_dtype!r} is Meta's DDP communication_dtype "
                "(its DDPDistributedConfig needs a process group; this backend runs one process)")
    return None


@st.composite
def _kwargs(draw: Any) -> dict[str, Any]:
    """``DistributedShampoo`` kwargs (JSON form) that precondition within a few steps.

    Small blocks, roots every 1-3 steps, each grafting and root method, both
    preconditioner classes, and Meta's defaults where an argument is absent
    (float32 roots and eigenvectors included).
    """
    freq = draw(st.integers(1, 3))
    beta1 = draw(st.sampled_from([0.0, 0.9]))
    kwargs: dict[str, Any] = {
        # Exact in float32: Meta multiplies by a float32 lr tensor (DEVIATIONS).
        "lr": draw(st.sampled_from([0.0625, 0.125, 0.5])),
        "betas": [beta1, draw(st.sampled_from([1.0, 0.999, 0.9]))],
        # beta3 = beta1 (-1) with beta1 > 0 and no bias correction makes Meta precondition
        # its filter state in place (DEVIATIONS): drawn apart.
        "beta3": draw(st.sampled_from([-1.0, 0.5] if beta1 == 0.0 else [0.5])),
        # The suite's well-conditioned range (strategies.configs); Meta's default
        # 1e-12 leaves null directions of the factors amplified ~1e6 by the root.
        "epsilon": draw(st.sampled_from([1e-3, 1e-2, 0.1])),
        # Off: Meta computes its bias corrections in float32 (DEVIATIONS).
        "use_bias_correction": False,
        "weight_decay": draw(st.sampled_from([0.0, 0.01])),
        "weight_decay_type": draw(st.sampled_from(["L2", "DECOUPLED", "INDEPENDENT"])),
        "max_preconditioner_dim": draw(st.sampled_from([2, 3, 5, 1024])),
        "precondition_frequency": freq,
        "start_preconditioning_step": draw(st.sampled_from([-1, freq, freq + 1])),
        "use_pin_memory": False,
    }
    if draw(st.booleans()):
        kwargs["iterate_averaging_config"] = {
            "type": "ClassicMomentumConfig", "momentum": 0.9,
            "dampening": draw(st.sampled_from([0.0, 0.1])), "use_nesterov": draw(st.booleans()),
        }
    graft = draw(st.sampled_from([None, "SGD", "AdaGrad", "RMSprop", "Adam"]))
    if graft is not None:
        kwargs["grafting_config"] = {"type": f"{graft}PreconditionerConfig"}
        if graft != "SGD":
            kwargs["grafting_config"]["epsilon"] = draw(st.sampled_from([1e-10, 1e-8]))
        if graft == "RMSprop":
            kwargs["grafting_config"]["beta2"] = draw(st.sampled_from([0.9, 0.999]))
        if graft == "Adam":  # 1 - beta2 ** t exact in float32 for t <= 15 (DEVIATIONS)
            kwargs["grafting_config"]["beta2"] = 0.75
    if draw(st.booleans()):
        pc: dict[str, Any] = {
            "type": "EigenvalueCorrectedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": draw(st.sampled_from(
                ["EighEigendecompositionConfig", "QREigendecompositionConfig"]))},
        }
        if graft is None:  # Meta corrects from step 1 without a graft (eq. 17).
            kwargs["precondition_frequency"] = kwargs["start_preconditioning_step"] = 1
    else:
        method = draw(st.sampled_from(["EigenConfig", "CoupledNewtonConfig"]))
        pc = {"type": "RootInvShampooPreconditionerConfig",
              "amortized_computation_config": {"type": method}}
        if draw(st.booleans()):
            pc["inverse_exponent_override"] = {2: draw(st.sampled_from([0.25, 0.5, 1.0]))}
    kwargs["preconditioner_config"] = pc
    diagonal = draw(st.sampled_from([None, None, None, "SGD", "AdaGrad", "RMSprop", "Adam",
                                     "SignDescent"]))
    if diagonal is not None:  # eq. (16b): a first-order class as the preconditioner
        kwargs["preconditioner_config"] = {"type": f"{diagonal}PreconditionerConfig"}
        if diagonal == "RMSprop":
            kwargs["preconditioner_config"]["beta2"] = draw(st.sampled_from([0.9, 0.999]))
        if diagonal == "Adam":  # without drop_weighting_factor_on_gsquare its 1 - beta2^t
            # is float32 (DEVIATIONS)
            kwargs["preconditioner_config"]["drop_weighting_factor_on_gsquare"] = True
    return kwargs


def base_config() -> ShampooConfig:
    """Meta's config nearest ``ShampooConfig()``, where the suite's fixed laws start.

    ``ShampooConfig()``'s values where Meta has an argument for them (no
    gradient filter or graft, roots every step from step 1, Meta's default
    epsilon 1e-12), Meta's own rules where it has none (dims merged up to
    the block size, root failures tolerated, float32 roots stored).
    """
    return from_meta({"lr": 0.125, "betas": [0.0, 1.0], "precondition_frequency": 1,
                      "start_preconditioning_step": 1, "grafting_config": None,
                      "use_bias_correction": False})


def configs() -> st.SearchStrategy[ShampooConfig]:
    """Configs Meta expresses: its own kwargs, drawn and imported with ``from_meta``."""
    return _kwargs().map(from_meta)


# ---------------------------------------------------------------------- running
def _optimizer(config: ShampooConfig, tensors: list[torch.nn.Parameter],
               dtype: Any) -> DistributedShampoo:
    reason = expressible(config, dtype)
    if reason is not None:
        raise Inexpressible(f"backend 'meta': {reason}")
    return DistributedShampoo(tensors, **meta_kwargs(to_meta(in_dtype(config, dtype))))


def run(
    config: ShampooConfig,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    dtype: Any = np.float64,
) -> list[dict[str, np.ndarray]]:
    """The parameters (as ``dtype`` arrays) after each step of ``grads``, Meta stepping."""
    return run_optimizer("meta", _optimizer, config, params, grads, dtype)


def stepper(
    optimizer: str,
    params: dict[str, np.ndarray],
    *,
    lr: float,
    config: ShampooConfig | None = None,
    weight_decay: float = 0.0,
    dtype: Any = np.float64,
) -> Stepper:
    """A closed-loop :class:`~shampoo_conformance.adapters.torch.Stepper`: Meta's
    ``DistributedShampoo`` from ``config`` (default :func:`base_config`) with learning
    rate ``lr``, or ``torch.optim.AdamW`` (as the torch backend's)."""
    return make_stepper("meta", _optimizer, optimizer, params, lr, config, weight_decay,
                        base_config(), dtype)


# ------------------------------------ the registry's user-run hooks (thirdparty/registry.py)
#: What a user passes ``DistributedShampoo(params, lr=...)``: the learning rate (its
#: default is 0.01 too), everything else at Meta's defaults.
USER_KWARGS: dict[str, Any] = {"lr": 1e-2}


def defaults_config() -> ShampooConfig:
    """Meta's defaults at :data:`USER_KWARGS`, imported (``from_meta`` fills every
    absent argument with Meta's default)."""
    return from_meta(USER_KWARGS)


def library_run(kwargs: dict[str, Any], params: dict[str, np.ndarray],
                grads: list[dict[str, np.ndarray]], dtype: Any) -> LibraryRun:
    """``DistributedShampoo(parameters, **kwargs)`` stepped as a user steps it."""
    return torch_library_run(lambda tensors, kw: DistributedShampoo(tensors, **kw), kwargs,
                             params, grads, dtype)

