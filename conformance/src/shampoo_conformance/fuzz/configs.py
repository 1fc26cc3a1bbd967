"""Config strategies: hostile recipes for every field of every section, step configs, importers.

- :func:`config_recipes`: a :class:`Recipe` (section -> field -> value) whose
  sections and fields come from ``dataclasses.fields`` of
  ``shampoo_spec.ShampooConfig`` and of each section class, so new fields and
  sections are fuzzed automatically. :meth:`Recipe.build` calls the
  constructors; :meth:`Recipe.as_dict` is the JSON form for
  ``ShampooConfig.from_dict``.
- :func:`step_configs`: valid configs with extreme but sane values (tiny and
  zero matrix epsilons, beta2 = 0 and 1, root-failure limits, both failure
  policies) for stepping through hostile gradients.
- :func:`meta_kwargs`, :func:`google_kwargs`: the anchors' arguments with
  wrong types, ``"false"`` strings and non-integral numbers for integers.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

import shampoo_spec as ss

from .values import OMIT, field_values, hostile_values

#: The section classes a union-typed field may hold (``root_inverse``).
_ROOT_METHODS: dict[str, type] = {"eigh": ss.EighConfig, "coupled_newton": ss.CoupledNewtonConfig}


@dataclass(frozen=True)
class Section:
    """One section to construct: ``cls(**kwargs)``."""

    cls: type
    kwargs: dict[str, Any]

    def build(self) -> Any:
        kwargs = dict(self.kwargs)
        if self.cls is ss.ExponentConfig and isinstance(kwargs.get("overrides_by_order"), list):
            kwargs["overrides_by_order"] = tuple(
                item.build() if isinstance(item, Section) else item
                for item in kwargs["overrides_by_order"]
            )
        return self.cls(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        out = {k: _plain(v) for k, v in self.kwargs.items()}
        if self.cls in _ROOT_METHODS.values() and "method" not in out:
            out["method"] = "eigh" if self.cls is ss.EighConfig else "coupled_newton"
        return out


def _plain(value: Any) -> Any:
    if isinstance(value, Section):
        return value.as_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Recipe:
    """Top-level fields of a ShampooConfig: raw values or :class:`Section` s."""

    fields: dict[str, Any]

    def build(self) -> ss.ShampooConfig:
        """``ShampooConfig(**fields)`` with each section constructed first."""
        kwargs = {k: v.build() if isinstance(v, Section) else v for k, v in self.fields.items()}
        return ss.ShampooConfig(**kwargs)

    def as_dict(self) -> dict[str, Any]:
        return {k: _plain(v) for k, v in self.fields.items()}

    def names(self) -> set[str]:
        """Every field name set anywhere in the recipe (errors must name one of them)."""
        out = set(self.fields)
        for v in self.fields.values():
            if isinstance(v, Section):
                out |= set(v.kwargs)
                items = v.kwargs.get("overrides_by_order")
                for item in items if isinstance(items, (list, tuple)) else ():
                    if isinstance(item, Section):
                        out |= set(item.kwargs)
        return out


def _section_classes(hint: Any) -> list[type]:
    """The config dataclasses a ShampooConfig field may hold."""
    candidates = [*typing.get_args(hint), hint]
    return [a for a in candidates if isinstance(a, type) and dataclasses.is_dataclass(a)]


@st.composite
def section_recipes(draw: Any, cls: type) -> Section:
    """Every field of section ``cls``, each omitted, valid-looking or hostile."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if cls is ss.ExponentConfig and f.name == "overrides_by_order" and draw(st.booleans()):
            kwargs[f.name] = draw(st.lists(section_recipes(ss.OrderOverride), max_size=2))
            continue
        value = draw(field_values(cls, f))
        if value is not OMIT:
            kwargs[f.name] = value
    return Section(cls, kwargs)


@st.composite
def config_recipes(draw: Any) -> Recipe:
    """A recipe over every field of ShampooConfig and of each of its sections."""
    hints = typing.get_type_hints(ss.ShampooConfig)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(ss.ShampooConfig):
        classes = _section_classes(hints[f.name])
        if classes:
            mode = draw(st.sampled_from(["omit"] * 3 + ["section"] * 6 + ["hostile"]))
            if mode == "section":
                fields[f.name] = draw(section_recipes(draw(st.sampled_from(classes))))
            elif mode == "hostile":
                fields[f.name] = draw(hostile_values())
        else:
            value = draw(field_values(ss.ShampooConfig, f))
            if value is not OMIT:
                fields[f.name] = value
    return Recipe(fields)


# ----------------------------------------------------------- step configs
@st.composite
def step_configs(
    draw: Any, policy: str | None = None, coupling_free: bool = False
) -> ss.ShampooConfig:
    """A valid config with extreme-but-sane values, for stepping through hostile data.

    Sane: ``learning_rate <= 1`` and ``weight_decay <= 0.1`` (so the weights
    cannot legitimately diverge in the few steps drawn), dividing epsilons
    >= 1e-12 where a division by a small second moment is not bounded by
    construction (eq. 17); the matrix epsilon may be 0 or 1e-30 (a failed
    root is kept and counted, eq. 13). ``policy`` fixes
    ``failure.nonfinite_gradient``; ``coupling_free`` keeps blocks
    independent (graft norms per block, no normalised or Adafactor graft), so that a
    refused block can be compared with a zero one (invariant c).
    """
    eigen = draw(st.booleans()) and draw(st.booleans())
    # Eq. (10b): 1e-30 fails nearly every root (eigenbases included), 0.1 almost none.
    root_inverse: ss.RootInverseConfig = ss.EighConfig(
        failure_threshold=draw(st.sampled_from([None, None, 0.1, 1e-30]))
    )
    if not eigen and draw(st.booleans()):
        root_inverse = ss.CoupledNewtonConfig(
            max_iterations=draw(st.sampled_from([1, 5, 100])),
            tolerance=draw(st.sampled_from([1e-6, 1e-12])),
            error_growth_limit=draw(st.sampled_from([None, 1.2])),
            retries=draw(st.sampled_from([0, 2])),
            failure_threshold=draw(st.sampled_from([None, 0.1, 1e-30])),
        )
    elif not eigen and draw(st.booleans()):
        # Eq. (11c): no ridge at all (a singular factor's root fails), or a tiny one.
        root_inverse = ss.HigherOrderNewtonConfig(
            order=draw(st.sampled_from([2, 3, 5])),
            rel_epsilon=draw(st.sampled_from([0.0, 1e-6])),
            abs_epsilon=draw(st.sampled_from([0.0, 1e-30, 1e-3])),
            max_iterations=draw(st.sampled_from([1, 5, 100])),
        )
    newton = isinstance(root_inverse, ss.CoupledNewtonConfig)
    overrides = [ss.ExponentConfig(), ss.ExponentConfig(default="preconditioned_dims"),
                 ss.ExponentConfig(override=1.0),
                 ss.ExponentConfig(
                     overrides_by_order=(ss.OrderOverride(order=2, roots=(4.0, 0.0)),))]
    if not newton:
        overrides.append(ss.ExponentConfig(override=0.5))
    # Eq. (14e)'s moments span the parameter's blocks, as a normalised graft's norm does.
    gtypes = [t for t in ss.GRAFTING_TYPES
              if not (coupling_free and (t.endswith("_normalized") or t == "adafactor"))]
    gtype = draw(st.sampled_from(gtypes))
    adaptive_ema = gtype in ("rmsprop", "adam", "rmsprop_normalized")
    adafactor = gtype == "adafactor"
    grafting = ss.GraftingConfig(
        type=gtype,
        beta2=draw(st.sampled_from([1e-12, 0.5, 0.999, 1.0 - 1e-12])) if adaptive_ema else 1.0,
        ema_weight=draw(st.sampled_from(["one_minus_beta2", "one"])) if adaptive_ema
        else "one_minus_beta2",
        epsilon=draw(st.sampled_from([1e-30, 1e-10, 1.0])),
        bias_correction=not adafactor and draw(st.booleans()),
        norm_scope="block" if coupling_free else draw(st.sampled_from(["block", "parameter"])),
        norm_epsilon=draw(st.sampled_from([1e-30, 1e-16])),
        normalize_epsilon=draw(st.sampled_from([1e-30, 1e-16])),
        # Eq. (14e): its epsilon is inside the moments; c near 0 keeps beta_t near 0.
        **({"epsilon_placement": "inside_sqrt",
            "decay_exponent": draw(st.sampled_from([1e-12, 0.8, 1.0])),
            "factor_min_dim": draw(st.sampled_from([1, 2, 128])),
            "parameter_scale_floor": draw(st.sampled_from([None, 2.0**-126, 1e-3])),
            "clip_rms": draw(st.sampled_from([None, 2.0**-126, 1.0]))}
           if adafactor else {}),
    )
    mu = draw(st.sampled_from([0.0, 0.9, 1.0 - 1e-12]))
    config = ss.ShampooConfig(
        learning_rate=draw(st.sampled_from([0.0, 1e-3, 0.1, 1.0])),
        statistics=ss.StatisticsConfig(
            beta2=draw(st.sampled_from([1.0, 0.0, 0.9, 1.0 - 1e-12])),
            ema_weight=draw(st.sampled_from(["one_minus_beta2", "one"])),
            bias_correction=draw(st.booleans()),
            initial_value=draw(st.sampled_from(["zero", "epsilon_identity"])),
        ),
        epsilon=ss.EpsilonConfig(
            value=draw(st.sampled_from([0.0, 1e-30, 1e-12, 1e-6, 1.0])),
            scale=draw(st.sampled_from(["absolute", "relative"])),
            relative_floor=draw(st.sampled_from([0.0, 1e-16, 1e-6])),
            placement=draw(st.sampled_from(["ridge", "shift_after", "floor", "ridge_floor"])),
        ) if eigen or not isinstance(root_inverse, ss.EighConfig) or draw(st.booleans()) else (
            # Eq. (10) pseudo-inverse: rtol 0 inverts rounding noise (huge roots, the
            # update guard's case); None is n u_f.
            ss.EpsilonConfig(value=0.0, placement="pseudo_inverse",
                             rank_rtol=draw(st.sampled_from([0.0, None, 1e-6])),
                             rank_atol=draw(st.sampled_from([0.0, 1e-30])))),
        root_inverse=root_inverse,
        exponents=draw(st.sampled_from(overrides)),
        eigenvalue_correction=ss.EigenvalueCorrectionConfig(
            beta2=draw(st.sampled_from([0.0, 0.999, 1.0])),
            ema_weight=draw(st.sampled_from(["one_minus_beta2", "one"])),
            epsilon=draw(st.sampled_from([1e-12, 1e-8])),
            bias_correction=draw(st.booleans()),
            # Eq. (17a): Q_k and D stored rounded (D not in float16: these epsilons
            # are below its smallest positive number, which the config refuses).
            eigenvectors_dtype=draw(
                st.sampled_from([None, None, "float32", "bfloat16", "float16"])),
            corrected_eigenvalues_dtype=draw(st.sampled_from([None, None, "float32", "bfloat16"])),
            basis_reuse_tolerance=draw(st.sampled_from([0.0, 0.0, 0.1, 1.0])),  # eq. (17b)
            # Eq. (17c): QR steps from the stored basis (no eq. 10b threshold with it).
            **({"eigenbasis_method": "qr", "qr_max_iterations": draw(st.sampled_from([0, 1, 3]))}
               if isinstance(root_inverse, ss.EighConfig) and root_inverse.failure_threshold is None
               and draw(st.booleans()) else {}),
        ) if eigen else None,
        grafting=grafting,
        gradient_filter=ss.GradientFilterConfig(
            beta1=draw(st.sampled_from([0.0, 0.9, 1.0 - 1e-12])),
            beta3=draw(st.sampled_from([None, 0.0, 0.5])),
            bias_correction=draw(st.booleans()),
        ),
        momentum=ss.MomentumConfig(
            momentum=mu,
            dampening=draw(st.sampled_from([0.0, 0.5])),
            nesterov=draw(st.booleans()),
            buffers="separate" if gtype != "none" and draw(st.booleans()) else "shared",
            learning_rate_placement=draw(st.sampled_from(["after_momentum", "before_momentum"])),
        ),
        weight_decay=ss.WeightDecayConfig(
            value=draw(st.sampled_from([0.0, 0.1])),
            type=draw(st.sampled_from(["l2", "direction", "update"])),
        ),
        blocking=ss.BlockingConfig(
            max_preconditioner_dim=draw(st.sampled_from([1, 2, 3, 4, 1024])),
            merge_dims_up_to=draw(st.sampled_from([None, 1, 8])),
            merge_direction=draw(st.sampled_from(["last_to_first", "first_to_last"])),
            skip_dim_size_gt=draw(st.sampled_from([None, 4])),
            skip_rank_lt=draw(st.sampled_from([0, 2])),
            preconditioned_dims=draw(st.sampled_from(["all", "all_but_last", "last"])),
        ),
        schedule=ss.ScheduleConfig(
            precondition_frequency=draw(st.sampled_from([1, 2])),
            statistics_frequency=draw(st.sampled_from([1, 2])),
            start_preconditioning_step=draw(st.sampled_from([1, 2, None])),
            period_anchor=draw(st.sampled_from(["end", "start"])),
            roots_before_start=draw(st.booleans()),
            roots_take_effect="same_step" if eigen else draw(
                st.sampled_from(["same_step", "next_step"])),
        ),
        failure=ss.FailureConfig(
            nonfinite_gradient=_policy(policy or draw(st.sampled_from(["raise", "skip_block"]))),
            max_consecutive_root_failures=draw(st.sampled_from([None, None, 0, 2])),
        ),
        # Roots stored rounded (eqs. 11a, 16; not with eigenvalue correction): float16
        # roots overflow (a failed root, eq. 13) and products overflow (eq. 22).
        inverse_root_dtype=None if eigen else draw(
            st.sampled_from([None, None, "float32", "bfloat16", "float16"])),
        # Updates rounded (eq. 21a): a float16 update beyond 65504 is withheld (eq. 22).
        update_dtype=draw(st.sampled_from([None, None, "float32", "bfloat16", "float16"])),
    )
    # Factors stored in bfloat16/float16 (eq. 11b) where the config allows it; float16
    # refuses blocks whose factors could pass 2^15 (eq. 3) and needs eps >= 2^-24.
    if (not eigen and type(root_inverse) is ss.EighConfig
            and root_inverse.failure_threshold is None and config.epsilon.scale == "absolute"
            and config.epsilon.placement in ("ridge", "shift_after")
            and config.statistics.initial_value == "zero"):
        allowed = ["bfloat16"] + (["float16"] if config.epsilon.value >= 2.0**-24 else [])
        storage = draw(st.sampled_from([None, None, *allowed]))
        if storage is not None:
            config = dataclasses.replace(config, factor_storage_dtype=storage)
    return config


def _policy(name: str) -> typing.Literal["raise", "skip_block"]:
    return "raise" if name == "raise" else "skip_block"


# ------------------------------------------------------------- importers
#: Meta keys read as booleans, as integers, and as plain numbers.
META_BOOLS = ("use_bias_correction", "use_nesterov", "use_decoupled_weight_decay",
              "use_merge_dims")
META_INTS = ("max_preconditioner_dim", "precondition_frequency", "start_preconditioning_step")
META_NUMBERS = ("lr", "beta3", "epsilon", "momentum", "dampening", "weight_decay")
#: Google keys read as booleans, as integers, and as plain numbers.
GOOGLE_BOOLS = ("nesterov", "eigh", "relative_matrix_epsilon", "decoupled_learning_rate",
                "moving_average_for_momentum", "decoupled_weight_decay",
                "best_effort_shape_interpretation", "decay_preconditioning_compute_steps")
GOOGLE_INTS = ("block_size", "start_preconditioning_step", "preconditioning_compute_steps",
               "statistics_compute_steps", "skip_preconditioning_rank_lt",
               "skip_preconditioning_dim_size_gt", "merge_small_dims_block_size",
               "end_preconditioning_compute_steps")
GOOGLE_NUMBERS = ("learning_rate", "beta1", "beta2", "diagonal_epsilon", "matrix_epsilon",
                  "weight_decay", "exponent_override", "inverse_failure_threshold",
                  "clip_by_scaled_gradient_norm")

#: Non-bool values that a lax importer reads as True or False.
NOT_BOOLS: tuple[Any, ...] = ("false", "true", "False", "0", "", 0, 1, 1.0, None, [], "no")
#: Numbers that are not integers (a lax importer truncates them).
NOT_INTS: tuple[Any, ...] = (2.5, 1.5, 1e-3, 4096.5, 2**31 + 0.5, 1e300)


@st.composite
def _importer_kwargs(
    draw: Any, bools: tuple[str, ...], ints: tuple[str, ...], numbers: tuple[str, ...],
    required: dict[str, Any],
) -> dict[str, Any]:
    out = dict(required)
    for key in bools:
        mode = draw(st.sampled_from(["omit"] * 4 + ["bool", "hostile"]))
        if mode == "bool":
            out[key] = draw(st.booleans())
        elif mode == "hostile":
            out[key] = draw(st.one_of(st.sampled_from(NOT_BOOLS), hostile_values()))
    for key in ints:
        mode = draw(st.sampled_from(["omit"] * 4 + ["int", "not_int", "hostile"]))
        if mode == "int":
            out[key] = draw(st.integers(min_value=-2, max_value=5000))
        elif mode == "not_int":
            out[key] = draw(st.sampled_from(NOT_INTS))
        elif mode == "hostile":
            out[key] = draw(hostile_values())
    for key in numbers:
        mode = draw(st.sampled_from(["omit"] * 4 + ["number", "hostile"]))
        if mode == "number":
            out[key] = draw(st.sampled_from([0.0, 1e-12, 0.5, 0.9, 1.0, 2.0, -1.0]))
        elif mode == "hostile":
            out[key] = draw(hostile_values())
    return out


def meta_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    """``DistributedShampoo`` kwargs: wrong types, ``"false"`` strings, 2.5 for integers."""
    base = _importer_kwargs(META_BOOLS, META_INTS, META_NUMBERS, {})

    @st.composite
    def extra(draw: Any) -> dict[str, Any]:
        out = draw(base)
        if draw(st.booleans()):
            out["betas"] = draw(st.one_of(
                st.tuples(st.sampled_from([0.0, 0.9, 1.0, -0.1, 1.5]),
                          st.sampled_from([0.0, 0.999, 1.0, 2.0])),
                hostile_values()))
        if draw(st.booleans()):
            out["grafting_config"] = draw(st.one_of(
                st.none(), hostile_values(),
                st.fixed_dictionaries({
                    "type": st.sampled_from(["AdaGradPreconditionerConfig",
                                             "AdamPreconditionerConfig",
                                             "RMSpropPreconditionerConfig", "SGD", ""]),
                }, optional={"epsilon": hostile_values(), "beta2": hostile_values(),
                             "drop_weighting_factor_on_gsquare": hostile_values()})))
        if draw(st.booleans()):
            out["preconditioner_config"] = draw(st.one_of(
                hostile_values(),
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["RootInvShampooPreconditionerConfig",
                                              "EigenvalueCorrectedShampooPreconditionerConfig"])},
                    optional={
                        "num_tolerated_failed_amortized_computations": st.one_of(
                            st.sampled_from(NOT_INTS), hostile_values()),
                        "factor_matrix_dtype": hostile_values(),
                        "inverse_exponent_override": st.one_of(
                            hostile_values(),
                            st.dictionaries(st.one_of(st.integers(-1, 3), hostile_values()),
                                            hostile_values(), max_size=2)),
                    })))
        return dict(out)

    return extra()


def google_kwargs() -> st.SearchStrategy[dict[str, Any]]:
    """``distributed_shampoo`` kwargs (learning_rate and block_size required by Google)."""
    return st.builds(dict).flatmap(lambda _: _google())


@st.composite
def _google(draw: Any) -> dict[str, Any]:
    out = draw(_importer_kwargs(GOOGLE_BOOLS, GOOGLE_INTS, GOOGLE_NUMBERS,
                                {"learning_rate": 0.1, "block_size": 128}))
    if draw(st.booleans()):
        out["graft_type"] = draw(st.one_of(
            st.sampled_from(["SGD", "ADAGRAD", "RMSPROP", "SQRT_N", "sgd", "NOPE"]),
            hostile_values()))
    if draw(st.booleans()):
        out["preconditioner_type"] = draw(st.one_of(
            st.sampled_from(["ALL", "INPUT", "OUTPUT", "all"]), hostile_values()))
    return dict(out)




# ------------------------------------------------------ fixed JAX programs
#: The parameter shapes every fixed case shares (0-d to 3-d, a size-1 dim).
FIXED_SHAPES: dict[str, tuple[int, ...]] = {
    "p0_w2d": (5, 3), "p1_w1d": (7,), "p2_w0d": (), "p3_w3d": (2, 1, 4),
}


def fixed_configs() -> list[ss.ShampooConfig]:
    """A few configs compiled once each, through which JAX fuzzes many gradient streams.

    The first two and the last keep blocks independent (invariant c); between
    them they cover both root methods, eigenvalue correction, every kind of
    weight decay, filtering, separate momentum buffers, skip rules, relative
    and zero epsilons, and roots stored in bfloat16 (eqs. 11a, 16).
    """
    return [
        ss.ShampooConfig(
            learning_rate=0.1,
            grafting=ss.GraftingConfig(type="adagrad"),
            momentum=ss.MomentumConfig(momentum=0.9, nesterov=True),
            weight_decay=ss.WeightDecayConfig(value=0.1, type="l2"),
            blocking=ss.BlockingConfig(max_preconditioner_dim=4, merge_dims_up_to=None),
            inverse_root_dtype="bfloat16",
        ),
        ss.ShampooConfig(
            learning_rate=0.01,
            statistics=ss.StatisticsConfig(beta2=0.999, bias_correction=True),
            eigenvalue_correction=ss.EigenvalueCorrectionConfig(beta2=0.999),
            grafting=ss.GraftingConfig(type="adam", beta2=0.999, bias_correction=True),
            gradient_filter=ss.GradientFilterConfig(beta1=0.9, bias_correction=True),
            weight_decay=ss.WeightDecayConfig(value=0.1, type="direction"),
            blocking=ss.BlockingConfig(max_preconditioner_dim=3, merge_dims_up_to=8),
            schedule=ss.ScheduleConfig(precondition_frequency=2),
        ),
        ss.ShampooConfig(
            learning_rate=0.1,
            statistics=ss.StatisticsConfig(beta2=0.0, initial_value="epsilon_identity"),
            epsilon=ss.EpsilonConfig(value=1e-6, scale="relative", placement="ridge_floor"),
            root_inverse=ss.CoupledNewtonConfig(error_growth_limit=1.2, retries=2,
                                                failure_threshold=0.1),
            exponents=ss.ExponentConfig(default="preconditioned_dims"),
            grafting=ss.GraftingConfig(type="rmsprop_normalized", beta2=0.9,
                                       norm_scope="parameter"),
            momentum=ss.MomentumConfig(momentum=0.9, buffers="separate",
                                       learning_rate_placement="before_momentum"),
            weight_decay=ss.WeightDecayConfig(value=0.1, type="update"),
            blocking=ss.BlockingConfig(skip_dim_size_gt=6),
            schedule=ss.ScheduleConfig(start_preconditioning_step=2, period_anchor="start",
                                       roots_before_start=True),
            failure=ss.FailureConfig(max_consecutive_root_failures=2),
        ),
        ss.ShampooConfig(
            learning_rate=1.0,
            epsilon=ss.EpsilonConfig(value=0.0, placement="floor"),
            exponents=ss.ExponentConfig(override=1.0),
            grafting=ss.GraftingConfig(type="sgd"),
            blocking=ss.BlockingConfig(merge_dims_up_to=None, max_preconditioner_dim=2),
        ),
    ]


@st.composite
def fixed_cases(draw: Any, policy: str | None = None, coupling_free: bool = False,
                configs: list[ss.ShampooConfig] | None = None) -> ss.ShampooConfig:
    """One of ``configs`` (default :func:`fixed_configs`) with a failure policy (``policy``
    or drawn)."""
    configs = fixed_configs() if configs is None else configs
    if coupling_free:
        configs = [c for c in configs
                   if c.grafting.rescale_scope != "parameter"
                   and not c.grafting.normalizes_input]
    config: ss.ShampooConfig = draw(st.sampled_from(configs))
    chosen = policy or draw(st.sampled_from(["raise", "skip_block"]))
    failure = dataclasses.replace(config.failure, nonfinite_gradient=_policy(chosen))
    return dataclasses.replace(config, failure=failure)

__all__ = [
    "FIXED_SHAPES",
    "GOOGLE_BOOLS",
    "GOOGLE_INTS",
    "META_BOOLS",
    "META_INTS",
    "NOT_BOOLS",
    "NOT_INTS",
    "Recipe",
    "Section",
    "config_recipes",
    "fixed_cases",
    "fixed_configs",
    "google_kwargs",
    "meta_kwargs",
    "section_recipes",
    "step_configs",
]
