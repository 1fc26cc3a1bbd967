"""Each section helper of the importers, on its own (docs/spec.md section 4).

Every helper maps its anchor arguments to one section of the config, takes
the anchor's default when a key is missing, and refuses a bad value naming
the key. The whole importers are tested in test_importers.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import shampoo_spec as ss
from shampoo_spec import anchors as importers
from shampoo_spec.anchors import _parse
from shampoo_spec.anchors.google import import_preconditioner as google_pre
from shampoo_spec.anchors.google import importer as google
from shampoo_spec.anchors.google import keys as google_keys
from shampoo_spec.anchors.meta import import_distribution as meta_dist
from shampoo_spec.anchors.meta import import_exponents as meta_exp
from shampoo_spec.anchors.meta import import_preconditioner as meta_pre
from shampoo_spec.anchors.meta import import_roots as meta_roots
from shampoo_spec.anchors.meta import importer as meta
from shampoo_spec.anchors.meta import keys as meta_keys


def m(**kwargs: Any) -> _parse.Args:
    return _parse.Args("from_meta", kwargs, meta_keys.KEYS)


def g(**kwargs: Any) -> _parse.Args:
    return _parse.Args("from_google", kwargs, google_keys.KEYS)


SHARED = meta_keys.Shared(lr=0.5, beta1=0.9, beta2=0.99, beta3=None, epsilon=1e-8,
                          bias_correction=True)


# ----------------------------------------------------------------- package
def test_package_keeps_the_public_names() -> None:
    from shampoo_spec import from_google, from_meta

    assert from_meta is importers.from_meta is meta.from_meta
    assert from_google is importers.from_google is google.from_google
    public = {"from_meta", "from_google", "from_tearfree", "meta_distribution",
              "MetaDistribution"}
    assert set(importers.__all__) == public | {"to_meta", "to_google", "to_tearfree"}
    assert public <= set(ss.__all__)
    assert ss.meta_distribution is meta_dist.meta_distribution


# ------------------------------------------------------------------ _parse
def test_args_refuses_unknown_keys_listing_the_allowed_ones() -> None:
    unknown = r"unknown key\(s\) \['x'\].*allowed keys are \['a', 'b'\]"
    with pytest.raises(ValueError, match=unknown):
        _parse.Args("cfg", {"a": 1, "x": 2}, {"a", "b"})
    with pytest.raises(ValueError, match="cfg = 3 is invalid"):
        _parse.Args("cfg", 3, {"a"})
    args = _parse.Args("cfg", {"a": 0, "type": "T"}, {"a", "b"})  # "type" is always allowed
    assert "a" in args and "b" not in args
    assert args.get("b", 7) == 7 and args.number("a", 1) == 0.0 and args.flag("b", True)


def test_args_unsupported_names_owner_key_and_value() -> None:
    args = _parse.Args("cfg", {"a": True, "b": None}, {"a", "b"})
    args.unsupported("b", False, "x")  # None means the default
    with pytest.raises(NotImplementedError, match=r"cfg\.a = True is not supported yet \(why\)"):
        args.unsupported("a", False, "why")


def test_number_dim_limit_choice_type_of() -> None:
    assert _parse.number("k", 3) == 3.0
    assert _parse.number("k", "inf", inf_ok=True) == float("inf")
    for bad in (True, "3", None, "inf", float("nan"), 10**400):
        with pytest.raises(ValueError, match="k = .* allowed a finite number"):
            _parse.number("k", bad)
    assert _parse.dim_limit("k", 8.0) == 8 and _parse.dim_limit("k", "inf") == _parse.UNBOUNDED
    for not_a_dim in (0, 2.5):
        with pytest.raises(ValueError, match="k = .* allowed an integer >= 1 or inf"):
            _parse.dim_limit("k", not_a_dim)
    assert _parse.choice("k", "A", {"A": 1, "B": 2}) == 1
    with pytest.raises(ValueError, match=r"k = 'C' is invalid: allowed one of \['A', 'B'\]"):
        _parse.choice("k", "C", {"B": 2, "A": 1})
    assert _parse.type_of("k", None) is None and _parse.type_of("k", {"type": "T"}) == "T"
    with pytest.raises(ValueError, match="k = .* 'type' key"):
        _parse.type_of("k", {"x": 1})


# -------------------------------------------------------------------- Meta
def test_meta_shared_defaults_and_values() -> None:
    assert meta._shared(m()) == meta_keys.Shared(
        lr=1e-2, beta1=0.9, beta2=1.0, beta3=None, epsilon=1e-12, bias_correction=True
    )
    s = meta._shared(m(lr=0.5, betas=[0.0, 0.99], beta3=0.5, epsilon=1e-8,
                       use_bias_correction=False))
    assert s == meta_keys.Shared(lr=0.5, beta1=0.0, beta2=0.99, beta3=0.5, epsilon=1e-8,
                            bias_correction=False)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"betas": [0.9]}, "betas"), ({"betas": [0.9, "x"]}, r"betas\[1\]"),
     ({"epsilon": -1e-8}, "epsilon"), ({"lr": "fast"}, "lr"), ({"beta3": None}, "beta3")],
)
def test_meta_shared_refuses(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key} = "):
        meta._shared(m(**kwargs))


def test_meta_weight_decay() -> None:
    assert meta._weight_decay(m(), 1.0) == ss.WeightDecayConfig(value=0.0, type="direction")
    assert meta._weight_decay(m(weight_decay=0.1, weight_decay_type="L2"), 1.0).type == "l2"
    assert meta._weight_decay(m(weight_decay_type="CORRECTED"), 1.0) == ss.WeightDecayConfig(
        value=0.0, type="direction", scale_by_lr_ratio=True)  # eq. (19): wd * lr_t / lr_0
    assert not meta._weight_decay(m(weight_decay_type="DECOUPLED"), 1.0).scale_by_lr_ratio
    with pytest.raises(ValueError, match="'CORRECTED' needs lr > 0"):
        meta._weight_decay(m(weight_decay_type="CORRECTED"), 0.0)
    # The legacy flag, unless weight_decay_type is given.
    assert meta._weight_decay(m(use_decoupled_weight_decay=False), 1.0).type == "l2"
    assert meta._weight_decay(
        m(use_decoupled_weight_decay=False, weight_decay_type="DECOUPLED"), 1.0
    ).type == "direction"
    # INDEPENDENT decays by wd, not lr * wd: value wd / lr.
    independent = meta._weight_decay(m(weight_decay=0.1, weight_decay_type="INDEPENDENT"), 0.5)
    assert independent == ss.WeightDecayConfig(value=0.2, type="direction")
    with pytest.raises(ValueError, match="weight_decay_type = 'INDEPENDENT' needs lr > 0"):
        meta._weight_decay(m(weight_decay_type="INDEPENDENT"), 0.0)
    with pytest.raises(ValueError, match="weight_decay_type = 'SOMETIMES'"):
        meta._weight_decay(m(weight_decay_type="SOMETIMES"), 1.0)
    with pytest.raises(ValueError, match="weight_decay.value"):
        meta._weight_decay(m(weight_decay=-1.0), 1.0)


def test_meta_momentum() -> None:
    assert meta._momentum(m()) == ss.MomentumConfig()
    assert meta._momentum(m(momentum=0.9, dampening=0.1, use_nesterov=True)) == ss.MomentumConfig(
        momentum=0.9, dampening=0.1, nesterov=True
    )
    classic = {"type": "ClassicMomentumConfig"}
    assert meta._momentum(m(iterate_averaging_config=classic)).momentum == 0.5  # Meta's default
    classic_nesterov = {**classic, "momentum": 0.8, "use_nesterov": True}
    c = meta._momentum(m(iterate_averaging_config=classic_nesterov))
    assert (c.momentum, c.nesterov, c.buffers) == (0.8, True, "shared")
    with pytest.raises(ValueError, match=r"iterate_averaging_config\.momentum = 1\.0"):
        meta._momentum(m(iterate_averaging_config={**classic, "momentum": 1.0}))
    with pytest.raises(ValueError, match=r"iterate_averaging_config has unknown key\(s\) \['mu'\]"):
        meta._momentum(m(iterate_averaging_config={**classic, "mu": 0.9}))
    with pytest.raises(NotImplementedError, match=r"iterate_averaging_config\.type = 'Polyak"):
        meta._momentum(m(iterate_averaging_config={"type": "PolyakAveragingConfig"}))


def test_meta_iterate_averaging() -> None:
    """Eq. (20d): GPA and Schedule-Free in place of momentum, with Meta's defaults; their
    scalars in float32 (eq. 20e), and to_meta refuses them in float64."""
    gpa = {"type": "GeneralizedPrimalAveragingConfig"}
    c = ss.from_meta({"iterate_averaging_config": gpa})
    assert c.averaging == ss.IterateAveragingConfig(type="gpa", train_interp=0.8,
                                                    eval_interp=0.9, scalar_dtype="float32")
    assert not c.momentum.enabled
    sf = ss.from_meta({"iterate_averaging_config": {
        "type": "ScheduleFreeConfig", "train_interp_coeff": 0.5, "eval_coeff_lr_power": 0}})
    assert sf.averaging == ss.IterateAveragingConfig(type="schedule_free", train_interp=0.5,
                                                     eval_lr_power=0, scalar_dtype="float32")
    wide = dataclasses.replace(sf, averaging=dataclasses.replace(sf.averaging,
                                                                 scalar_dtype=None))
    with pytest.raises(ValueError, match=r"averaging\.scalar_dtype = None.*float32"):
        ss.to_meta(wide)
    with pytest.raises(ValueError, match=r"averaging\.eval_interp = 1\.0"):
        ss.from_meta({"iterate_averaging_config": {**gpa, "eval_interp_coeff": 1.0}})
    with pytest.raises(ValueError, match=r"averaging\.train_interp = 0\.0"):
        ss.from_meta({"iterate_averaging_config": {**gpa, "train_interp_coeff": 0.0}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['eval_interp_coeff'\]"):
        ss.from_meta({"iterate_averaging_config": {"type": "ScheduleFreeConfig",
                                                   "eval_interp_coeff": 0.5}})
    with pytest.raises(ValueError, match=r"momentum\.momentum = 0\.9 is invalid: allowed 0 "
                                         r"with averaging"):
        ss.ShampooConfig(averaging=ss.IterateAveragingConfig(),
                         momentum=ss.MomentumConfig(momentum=0.9))
    with pytest.raises(ValueError, match=r"weight_decay\.type = 'update'"):
        ss.ShampooConfig(averaging=ss.IterateAveragingConfig(),
                         weight_decay=ss.WeightDecayConfig(value=0.1, type="update"))
    for config in (c, sf):
        assert ss.from_meta(ss.to_meta(config)) == config


def test_meta_distribution() -> None:
    for dist in (None, {"type": "DDPDistributedConfig"}, {"type": "SingleDeviceDistributedConfig"}):
        meta_dist._distribution(m(distributed_config=dist))
    with pytest.raises(NotImplementedError, match=r"distributed_config\.type = 'HSDP"):
        meta_dist._distribution(m(distributed_config={"type": "HSDPDistributedConfig"}))
    assert meta_dist._distribution(m(distributed_config={"type": "DDPDistributedConfig",
                                                    "target_parameter_dimensionality": 2})) == (
        2, "float32")
    for inf in ("inf", "Infinity", float("inf")):
        assert meta_dist._distribution(m(distributed_config={
            "type": "SingleDeviceDistributedConfig",
            "target_parameter_dimensionality": inf})) == (None, None)
    # Eq. (21a): DDP rounds every update to communication_dtype (float64: nothing).
    for comm, want in (("bfloat16", "bfloat16"), ("torch.float16", "float16"),
                       ("float32", "float32"), ("torch.float64", None)):
        assert meta_dist._distribution(m(distributed_config={
            "type": "DDPDistributedConfig", "communication_dtype": comm})) == (1, want)
    # communicate_params gathers the parameters themselves: rounded, not the update.
    assert meta_dist._distribution(m(distributed_config={
        "type": "DDPDistributedConfig", "communicate_params": True})) == (1, None)
    with pytest.raises(NotImplementedError, match="communicate_params = True"):
        meta_dist._distribution(m(distributed_config={
            "type": "DDPDistributedConfig", "communicate_params": True,
            "communication_dtype": "bfloat16"}))
    for key, bad in (("communication_dtype", "int8"), ("communicate_params", "yes")):
        with pytest.raises(ValueError, match=key):
            meta_dist._distribution(m(distributed_config={"type": "DDPDistributedConfig",
                                                          key: bad}))
    for bad in (0, 2.5, "2", True):
        with pytest.raises(ValueError, match="target_parameter_dimensionality"):
            meta_dist._distribution(m(distributed_config={"type": "DDPDistributedConfig",
                                                     "target_parameter_dimensionality": bad}))
    with pytest.raises(NotImplementedError, match="use_merge_dims"):
        meta_dist._distribution(m(use_merge_dims=False))


def test_meta_lossless_fully_shard() -> None:
    """FullyShard/HybridShard with REPLICATE or ROUND_ROBIN gather whole parameters
    (Meta's lossless distributors): single-device numerics; DEFAULT steps each rank's piece
    (imported with shard_local=True)."""
    fully, hybrid = "FullyShardDistributedConfig", "HybridShardDistributedConfig"
    mesh = {"device_mesh": [2, 2]}

    def read(kind: str, **dist: Any) -> tuple[int | None, ss.UpdateDtype | None]:
        return meta_dist._distribution(m(distributed_config={"type": kind, **dist}))

    for strategy in ("REPLICATE", "ROUND_ROBIN", "FSDPParamAssignmentStrategy.ROUND_ROBIN"):
        assert read(fully, param_assignment_strategy=strategy) == (1, None)
        assert read(fully, param_assignment_strategy=strategy, num_sub_groups=3,
                    target_parameter_dimensionality=2,
                    load_balancing_config={"type": "LoadBalancingConfig"}) == (2, None)
        # HybridShard all-gathers the updates over the replicas as DDP does (eq. 21a).
        assert read(hybrid, param_assignment_strategy=strategy, **mesh) == (1, "float32")
    assert read(fully, param_assignment_strategy="REPLICATE",
                target_parameter_dimensionality="inf") == (None, None)
    for comm, params, want in (("bfloat16", False, "bfloat16"), ("torch.float64", False, None),
                               ("float32", True, None)):
        assert read(hybrid, param_assignment_strategy="REPLICATE", communication_dtype=comm,
                    communicate_params=params, num_trainers_per_group=2, **mesh) == (1, want)
    with pytest.raises(NotImplementedError, match="communicate_params = True"):
        read(hybrid, param_assignment_strategy="REPLICATE", communication_dtype="float16",
             communicate_params=True, **mesh)
    # DEFAULT (Meta's default) steps each rank's piece: only with shard_local, which
    # takes nothing else; its update_dtype as the lossless strategies'.
    for kind, extra in ((fully, {}), (hybrid, mesh)):
        for given in ({}, {"param_assignment_strategy": "DEFAULT"}):
            with pytest.raises(ValueError,
                               match=r"param_assignment_strategy = 'DEFAULT' .*blocks each "
                                     r"rank's piece.*shard_local=True"):
                read(kind, **given, **extra)
            dist = {"type": kind, **given, **extra}
            assert meta_dist._distribution(m(distributed_config=dist), shard_local=True) == (
                1, None if kind == fully else "float32")
            assert ss.meta_distribution({"distributed_config": dist}) == "pieces"
        with pytest.raises(ValueError, match="shard_local = True is invalid with .*'REPLICATE'"):
            meta_dist._distribution(m(distributed_config={
                "type": kind, "param_assignment_strategy": "REPLICATE", **extra}),
                shard_local=True)
        assert ss.meta_distribution({"distributed_config": {
            "type": kind, "param_assignment_strategy": "ROUND_ROBIN"}}) == "whole_parameters"
    for dist in (None, {"type": "SingleDeviceDistributedConfig"}, {"type": "DDPDistributedConfig"}):
        with pytest.raises(ValueError, match="shard_local = True is invalid with "
                                             r"distributed_config\.type"):
            meta_dist._distribution(m(distributed_config=dist), shard_local=True)
    assert ss.meta_distribution({}) == "single_device"
    assert ss.meta_distribution({"distributed_config": {"type": "DDPDistributedConfig"}}) == "ddp"
    with pytest.raises(ValueError, match="shard_local = 1 is invalid"):
        ss.from_meta({}, shard_local=1)  # type: ignore[arg-type]
    for kind in ("FSDPDistributedConfig", "HSDPDistributedConfig"):
        with pytest.raises(NotImplementedError, match=rf"distributed_config\.type = '{kind}'"):
            read(kind)
        with pytest.raises(NotImplementedError, match=rf"distributed_config\.type = '{kind}'"):
            ss.meta_distribution({"distributed_config": {"type": kind}})
    # Meta's own rules and the keys' types.
    with pytest.raises(ValueError, match="num_sub_groups = 2 is invalid .*REPLICATE"):
        read(fully, num_sub_groups=2)
    for key, bad in (("num_sub_groups", 0), ("num_sub_groups", 1.5),
                     ("param_assignment_strategy", "SHARD"),
                     ("param_assignment_strategy", "WeightDecayType.REPLICATE"),
                     ("target_parameter_dimensionality", 0),
                     ("communication_dtype", "float32")):  # DDP's key, not FullyShard's
        with pytest.raises(ValueError, match=key):
            read(fully, **{"param_assignment_strategy": "REPLICATE", key: bad})
    for key, bad in (("communication_dtype", "int8"), ("num_trainers_per_group", 0),
                     ("communicate_params", 1), ("device_mesh", None)):
        with pytest.raises(ValueError, match=key):
            read(hybrid, **{**mesh, "param_assignment_strategy": "ROUND_ROBIN", key: bad})


def test_meta_preconditioner_defaults() -> None:
    p = meta_pre._preconditioner(m(), SHARED)
    assert p.statistics == ss.StatisticsConfig(beta2=0.99, bias_correction=True,
                                               initial_value="zero")
    assert p.epsilon == ss.EpsilonConfig(value=1e-8, scale="absolute", placement="ridge")
    assert p.root_inverse == ss.EighConfig()
    assert p.exponents == ss.ExponentConfig() and p.eigenvalue_correction is None
    assert p.factor_dtype == "float32" and p.failure.max_consecutive_root_failures == 3


def test_meta_preconditioner_values() -> None:
    p = meta_pre._preconditioner(m(preconditioner_config={
        "type": "RootInvShampooPreconditionerConfig",
        "amortized_computation_config": {"type": "CoupledNewtonConfig", "max_iterations": 20},
        "inverse_exponent_override": {"1": 0.25},
        "factor_matrix_dtype": "torch.float64",
        "num_tolerated_failed_amortized_computations": 0,
    }), SHARED)
    assert p.root_inverse == ss.CoupledNewtonConfig(max_iterations=20, tolerance=1e-6)
    assert p.exponents.overrides_by_order == (ss.OrderOverride(order=1, roots=(4.0,)),)
    assert p.factor_dtype == "float64" and p.failure.max_consecutive_root_failures == 0


@pytest.mark.parametrize(
    ("config", "match"),
    [({"type": "KLShampooPreconditionerConfig"}, r"preconditioner_config\.type = 'KL"),
     ({"type": "MyConfig"}, r"preconditioner_config\.type = 'MyConfig'"),
     ({"factor_matrix_dtype": "bfloat16", "use_trace_scaling": True},
      r"preconditioner_config\.factor_matrix_dtype = 'bfloat16' with "
      r"preconditioner_config\.use_trace_scaling"),
     ({"ignored_basis_change_dims": {"1": [0]}}, "ignored_basis_change_dims")],
)
def test_meta_preconditioner_refuses(config: dict[str, Any], match: str) -> None:
    config = {"type": "RootInvShampooPreconditionerConfig", **config}
    with pytest.raises(NotImplementedError, match=match):
        meta_pre._preconditioner(m(preconditioner_config=config), SHARED)
    with pytest.raises(ValueError, match=r"preconditioner_config has unknown key\(s\) \['x'\]"):
        meta_pre._preconditioner(m(preconditioner_config={"x": 1, "type": "T"}), SHARED)


def test_meta_root_inverse() -> None:
    assert meta_roots._root_inverse(None) == (
        ss.EighConfig(), {"placement": "ridge"}, {"basis_reuse_tolerance": 0.0})
    after = {"type": "EigenConfig",
             "rank_deficient_stability_config": {"type": "PerturbationConfig",
                                                 "perturb_before_computation": False}}
    assert meta_roots._root_inverse(after) == (
        ss.EighConfig(), {"placement": "shift_after"}, {"basis_reuse_tolerance": 0.0})
    assert meta_roots._root_inverse({"type": "CoupledNewtonConfig"}) == (
        ss.CoupledNewtonConfig(max_iterations=100, tolerance=1e-6), {"placement": "ridge"}, {}
    )
    # Eq. (17b): the eigenbasis reuse tolerance of eigenvalue correction's eigh config.
    eigh = {"type": "EighEigendecompositionConfig", "tolerance": 0.01}
    assert meta_roots._root_inverse(eigh, corrected=True) == (
        ss.EighConfig(), {"placement": "ridge"}, {"basis_reuse_tolerance": 0.01})
    # RootInv's EigenConfig: Meta's matrix_inverse_root_eigen passes tolerance=0.0.
    assert meta_roots._root_inverse({"type": "EigenConfig", "tolerance": 0.01}) == (
        ss.EighConfig(), {"placement": "ridge"}, {"basis_reuse_tolerance": 0.0})
    with pytest.raises(ValueError, match=r"amortized_computation_config\.tolerance"):
        meta_roots._root_inverse({"type": "EigenConfig", "tolerance": 2})
    # Eq. (10h): Eigendecomposed Shampoo's eigh root keeps its basis while it fits.
    assert meta_roots._root_inverse(eigh, eigendecomposed=True) == (
        ss.EighConfig(basis_reuse_tolerance=0.01), {"placement": "ridge"}, {})
    with pytest.raises(NotImplementedError, match=r"amortized_computation_config\.tolerance"):
        meta_roots._root_inverse({"type": "EigenConfig", "tolerance": 0.01}, corrected=True)
    pseudo = {"type": "EigenConfig", "rank_deficient_stability_config": {
        "type": "PseudoInverseConfig", "rank_rtol": None, "rank_atol": 1e-9}}
    assert meta_roots._root_inverse(pseudo) == (ss.EighConfig(), {
        "placement": "pseudo_inverse", "rank_rtol": None, "rank_atol": 1e-9},
        {"basis_reuse_tolerance": 0.0})
    assert meta_roots._root_inverse({"type": "EigenConfig", "rank_deficient_stability_config": {
        "type": "PseudoInverseConfig"}})[1] == {
        "placement": "pseudo_inverse", "rank_rtol": 0.0, "rank_atol": 0.0}
    with pytest.raises(ValueError, match=r"rank_deficient_stability_config\.type = 'Other' is "
                       "invalid: allowed 'PerturbationConfig' or 'PseudoInverseConfig'"):
        meta_roots._root_inverse({"type": "EigenConfig",
                            "rank_deficient_stability_config": {"type": "Other"}})
    with pytest.raises(ValueError, match=r"rank_deficient_stability_config\.rank_rtol = 'x'"):
        meta_roots._root_inverse({"type": "EigenConfig", "rank_deficient_stability_config": {
            "type": "PseudoInverseConfig", "rank_rtol": "x"}})
    higher = {"type": "CoupledHigherOrderConfig", "rel_epsilon": 1e-6, "abs_epsilon": 0.0,
              "order": 4, "tolerance": 1e-10, "disable_tf32": True}
    assert meta_roots._root_inverse(higher) == (ss.HigherOrderNewtonConfig(
        order=4, rel_epsilon=1e-6, abs_epsilon=0.0, tolerance=1e-10), {"placement": "ridge"}, {})
    with pytest.raises(ValueError, match=r"amortized_computation_config\.abs_epsilon is "
                       "required"):
        meta_roots._root_inverse({"type": "CoupledHigherOrderConfig", "rel_epsilon": 0.0})
    with pytest.raises(NotImplementedError, match=r"disable_tf32 = False"):
        meta_roots._root_inverse({**higher, "disable_tf32": False})
    with pytest.raises(ValueError, match=r"amortized_computation_config\.order = 1 is invalid"):
        meta_roots._root_inverse({**higher, "order": 1})
    with pytest.raises(ValueError, match=r"type = 'QREigendecompositionConfig' is invalid: "
                       "allowed only with EigenvalueCorrected"):
        meta_roots._root_inverse({"type": "QREigendecompositionConfig"})
    # Eq. (17c): Meta's QR algorithm for eigenvalue correction's eigenbases.
    assert meta_roots._root_inverse({"type": "QREigendecompositionConfig"}, corrected=True) == (
        ss.EighConfig(), {"placement": "ridge"},
        {"eigenbasis_method": "qr", "qr_max_iterations": 1, "basis_reuse_tolerance": 0.0})
    assert meta_roots._root_inverse({"type": "QREigendecompositionConfig", "max_iterations": 4,
                               "tolerance": 0.01}, corrected=True)[2] == {
        "eigenbasis_method": "qr", "qr_max_iterations": 4, "basis_reuse_tolerance": 0.01}
    with pytest.raises(ValueError, match=r"amortized_computation_config\.tolerance = 2"):
        meta_roots._root_inverse({"type": "QREigendecompositionConfig", "tolerance": 2},
                           corrected=True)


def test_meta_pseudo_inverse_needs_epsilon_zero_and_only_it() -> None:
    """Meta's rule: epsilon == 0 with PseudoInverseConfig, > 0 otherwise."""
    pseudo = {"type": "RootInvShampooPreconditionerConfig", "amortized_computation_config": {
        "type": "EigenConfig", "rank_deficient_stability_config": {
            "type": "PseudoInverseConfig", "rank_rtol": 1e-6}}}
    c = ss.from_meta({"epsilon": 0.0, "preconditioner_config": pseudo})
    assert c.epsilon == ss.EpsilonConfig(value=0.0, placement="pseudo_inverse", rank_rtol=1e-6)
    with pytest.raises(ValueError, match=r"epsilon = 1e-12 is invalid: allowed 0.0 with "
                       "rank_deficient_stability_config PseudoInverseConfig"):
        ss.from_meta({"preconditioner_config": pseudo})
    with pytest.raises(ValueError, match=r"epsilon = 0.0 is invalid: allowed a number > 0 "
                       r"\(0 only with PseudoInverseConfig\)"):
        ss.from_meta({"epsilon": 0.0})


def test_meta_exponents() -> None:
    assert meta_exp._exponents({}) == ss.ExponentConfig() == meta_exp._exponents(None, {})
    # Values are exponents e (root 1/e); a per-dim dict keeps the default 1/(2 order) elsewhere.
    e = meta_exp._exponents({"1": 0.5, "2": {"1": 0.125}, "3": 0})
    assert e.overrides_by_order == (
        ss.OrderOverride(order=1, roots=(2.0,)),
        ss.OrderOverride(order=2, roots=(4.0, 8.0)),
        ss.OrderOverride(order=3, roots=(0.0, 0.0, 0.0)),  # e = 0: not preconditioned
    )
    # Ignored basis-change dims get root 0, the others the default root 2 * order.
    assert meta_exp._exponents({}, {"2": [0]}).overrides_by_order == (
        ss.OrderOverride(order=2, roots=(0.0, 4.0)),
    )
    with pytest.raises(ValueError, match="inverse_exponent_override = .* allowed an object"):
        meta_exp._exponents([0.5])
    with pytest.raises(ValueError, match=r"inverse_exponent_override\.1 = 'x' is invalid"):
        meta_exp._exponents({"1": "x"})


def test_meta_eigenvalue_correction() -> None:
    corrected = {"type": "EigenvalueCorrectedShampooPreconditionerConfig"}
    p = meta_pre._preconditioner(m(preconditioner_config=corrected), SHARED)
    assert p.eigenvalue_correction == ss.EigenvalueCorrectionConfig(
        beta2=0.99, epsilon=1e-8, bias_correction=True, root=2.0
    )
    same = {**corrected, "inverse_exponent_override": {"1": 0.25, "2": 0.25}}
    assert meta_pre._preconditioner(m(preconditioner_config=same), SHARED).eigenvalue_correction
    # drop_weighting_factor_on_gsquare: weight 1 and no bias correction for the
    # factors and the corrected eigenvalues alike (one flag and one bc in Meta).
    drop = meta_pre._preconditioner(m(preconditioner_config={
        **corrected, "drop_weighting_factor_on_gsquare": True}), SHARED)
    assert drop.eigenvalue_correction == ss.EigenvalueCorrectionConfig(
        beta2=0.99, ema_weight="one", epsilon=1e-8, bias_correction=False, root=2.0)
    assert drop.statistics == ss.StatisticsConfig(beta2=0.99, ema_weight="one",
                                                  bias_correction=False)
    assert drop.eigenvalue_correction.update_weight == 1.0
    args = _parse.Args("preconditioner_config", same, meta_keys.PRECONDITIONER_KEYS)
    ec = meta_exp._eigenvalue_correction(args, SHARED, ss.EighConfig(), "ridge")
    # Orders Meta's map does not name keep exponent 1/2 (root 2), not the listed one.
    assert (ec.root, ec.roots_by_order) == (2.0, ((1, 4.0), (2, 4.0)))
    different = {**corrected, "inverse_exponent_override": {"1": 0.25, "2": 0.5}}
    ec = meta_pre._preconditioner(m(preconditioner_config=different), SHARED).eigenvalue_correction
    assert ec is not None and (ec.root, ec.roots_by_order) == (2.0, ((1, 4.0),))
    every = {**corrected, "inverse_exponent_override": {
        **{str(o): 0.25 for o in range(1, meta_exp.MAX_ORDER + 1)}, "3": 1.0}}
    ec = meta_pre._preconditioner(m(preconditioner_config=every), SHARED).eigenvalue_correction
    assert ec is not None and (ec.root, ec.roots_by_order) == (4.0, ((3, 1.0),))
    newton = {**corrected, "amortized_computation_config": {"type": "CoupledNewtonConfig"}}
    with pytest.raises(NotImplementedError, match="amortized_computation_config: eigenvalue"):
        meta_pre._preconditioner(m(preconditioner_config=newton), SHARED)


def test_meta_schedule() -> None:
    assert meta._schedule(m()) == ss.ScheduleConfig(
        precondition_frequency=1, start_preconditioning_step=1, period_anchor="end",
        roots_before_start=False,
    )
    s = meta._schedule(m(precondition_frequency=10))  # start -1 means the frequency
    assert (s.precondition_frequency, s.start_preconditioning_step) == (10, 10)
    assert meta._schedule(m(precondition_frequency=10,
                            start_preconditioning_step=25)).start_preconditioning_step == 25
    with pytest.raises(ValueError, match="start_preconditioning_step = 5 .* >= precondition"):
        meta._schedule(m(precondition_frequency=10, start_preconditioning_step=5))
    with pytest.raises(ValueError, match="precondition_frequency = 'x'"):
        meta._schedule(m(precondition_frequency="x"))


def test_meta_blocking() -> None:
    assert meta._blocking(m(), 1) == ss.BlockingConfig(
        max_preconditioner_dim=1024, merge_dims_up_to=1024, merge_direction="last_to_first"
    )
    b = meta._blocking(m(max_preconditioner_dim="inf"), 1)
    assert b.max_preconditioner_dim == b.merge_dims_up_to == _parse.UNBOUNDED
    with pytest.raises(ValueError, match="max_preconditioner_dim = 2.5"):
        meta._blocking(m(max_preconditioner_dim=2.5), 1)


def test_meta_grafting() -> None:
    assert meta_pre._grafting(None) == ss.GraftingConfig(type="none")
    assert meta_pre._grafting({"type": "SGDPreconditionerConfig"}).type == "sgd"
    assert meta_pre._grafting({"type": "AdaGradPreconditionerConfig"}) == ss.GraftingConfig(
        type="adagrad", epsilon=1e-10
    )
    assert meta_pre._grafting({"type": "RMSpropPreconditionerConfig"}) == ss.GraftingConfig(
        type="rmsprop", beta2=0.99, epsilon=1e-10, bias_correction=False
    )
    adam = meta_pre._grafting({"type": "AdamPreconditionerConfig", "epsilon": 1e-8})
    assert adam == ss.GraftingConfig(type="adam", beta2=0.999, epsilon=1e-8, bias_correction=True)
    assert adam.norm_scope == "block" and adam.norm_epsilon == 1e-16
    with pytest.raises(ValueError, match="grafting_config = 'adam'"):
        meta_pre._grafting("adam")
    with pytest.raises(ValueError, match=r"grafting_config has unknown key\(s\) \['beta1'\]"):
        meta_pre._grafting({"type": "AdamPreconditionerConfig", "beta1": 0.9})
    with pytest.raises(NotImplementedError, match=r"grafting_config\.type = 'Lion'"):
        meta_pre._grafting({"type": "Lion"})
    # drop_weighting_factor_on_gsquare: V <- beta2 V + G^2, and Meta then drops
    # Adam's bias correction too (RMSprop's and Adam's are the same method).
    for kind, default in (("RMSpropPreconditionerConfig", 0.99),
                          ("AdamPreconditionerConfig", 0.999)):
        g = meta_pre._grafting({"type": kind, "drop_weighting_factor_on_gsquare": True})
        assert (g.beta2, g.ema_weight, g.bias_correction) == (default, "one", False)
        assert g.update_weight == 1.0 and g.bias_correction_factor(3) == 1.0
    with pytest.raises(ValueError, match=r"drop_weighting_factor_on_gsquare"):
        meta_pre._grafting({"type": "AdamPreconditionerConfig",
                            "drop_weighting_factor_on_gsquare": 1})


def test_meta_diagonal_preconditioners() -> None:
    """Eq. (16b): Meta's first-order classes as ``preconditioner_config``."""
    for kind, want in (
        ("SGDPreconditionerConfig", ss.DiagonalPreconditionerConfig(type="sgd")),
        ("AdaGradPreconditionerConfig", ss.DiagonalPreconditionerConfig(type="adagrad")),
        ("RMSpropPreconditionerConfig",
         ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.99)),
        ("AdamPreconditionerConfig",
         ss.DiagonalPreconditionerConfig(type="adam", beta2=0.999, bias_correction=True)),
        ("SignDescentPreconditionerConfig", ss.DiagonalPreconditionerConfig(type="sign")),
    ):
        c = ss.from_meta({"preconditioner_config": {"type": kind}, "precondition_frequency": 7})
        assert c.diagonal == want
        # No graft: Meta applies the diagonal from step 1 (use_grafting_method False);
        # no roots, so the period has no effect.
        assert (c.schedule.start_preconditioning_step, c.schedule.precondition_frequency) == (1, 1)
        assert all(r == 0 for b in ss.plan_parameter((4, 6), c).blocks for r in b.roots)
        grafted = ss.from_meta({"preconditioner_config": {"type": kind},
                                "grafting_config": {"type": "AdaGradPreconditionerConfig"},
                                "precondition_frequency": 7})
        # With a graft: the graft before Meta's start (-1: the frequency, which sign
        # descent sets to 1 first).
        assert grafted.schedule.start_preconditioning_step == (
            1 if kind == "SignDescentPreconditionerConfig" else 7)
    dropped = ss.from_meta({"preconditioner_config": {
        "type": "AdamPreconditionerConfig", "beta2": 0.9, "epsilon": 1e-8,
        "drop_weighting_factor_on_gsquare": True}})
    assert dropped.diagonal == ss.DiagonalPreconditionerConfig(
        type="adam", beta2=0.9, epsilon=1e-8, ema_weight="one", bias_correction=False)
    with pytest.raises(NotImplementedError, match=r"preconditioner_config\.scale_fn"):
        ss.from_meta({"preconditioner_config": {
            "type": "SignDescentPreconditionerConfig", "scale_fn": "l1"}})
    with pytest.raises(ValueError, match=r"preconditioner_config has unknown key\(s\) \['beta1'\]"):
        ss.from_meta({"preconditioner_config": {"type": "AdamPreconditionerConfig",
                                                "beta1": 0.9}})


def test_meta_spectral_descent() -> None:
    """Eq. (16c): Meta's SpectralDescentPreconditionerConfig and its orthogonalizations."""
    spectral = {"type": "SpectralDescentPreconditionerConfig"}
    c = ss.from_meta({"preconditioner_config": spectral, "precondition_frequency": 7,
                      "distributed_config": {"type": "SingleDeviceDistributedConfig",
                                             "target_parameter_dimensionality": "inf"}})
    assert c.spectral == ss.SpectralDescentConfig()  # Newton-Schulz, Muon's coefficients
    # Meta sets target_parameter_dimensionality 2 and precondition_frequency 1.
    assert c.blocking.merge_target_rank == 2 and c.blocking.squeeze
    assert (c.schedule.start_preconditioning_step, c.schedule.precondition_frequency) == (1, 1)
    assert ss.plan_parameter((2, 3, 4), c).merged_shape == (2, 12)
    with pytest.raises(ValueError, match=r"parameter shape \(5,\) gives blocks of shape "
                                         r"\(5,\) with spectral descent"):
        ss.plan_parameter((5,), c)
    svd = ss.from_meta({"preconditioner_config": {**spectral, "orthogonalization_config": {
        "type": "SVDOrthogonalizationConfig", "scale_by_nuclear_norm": True}}})
    assert svd.spectral == ss.SpectralDescentConfig(method="svd", scale_by_nuclear_norm=True)
    ns = ss.from_meta({"preconditioner_config": {**spectral, "orthogonalization_config": {
        "type": "NewtonSchulzOrthogonalizationConfig", "num_iterations": 9,
        "coefficients": [3, -3.2, 1.2]}}})
    assert ns.spectral == ss.SpectralDescentConfig(num_iterations=9,
                                                   coefficients=(3.0, -3.2, 1.2))
    with pytest.raises(NotImplementedError, match=r"orthogonalization_config\.scale_by_dims_fn"):
        ss.from_meta({"preconditioner_config": {**spectral, "orthogonalization_config": {
            "type": "SVDOrthogonalizationConfig", "scale_by_dims_fn": "sqrt"}}})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['num_iterations'\]"):
        ss.from_meta({"preconditioner_config": {**spectral, "orthogonalization_config": {
            "type": "SVDOrthogonalizationConfig", "num_iterations": 3}}})
    with pytest.raises(ValueError, match=r"spectral\.scale_by_nuclear_norm = True"):
        ss.SpectralDescentConfig(scale_by_nuclear_norm=True)
    with pytest.raises(ValueError, match=r"spectral\.coefficients"):
        ss.SpectralDescentConfig(coefficients=(1.0, 2.0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"blocking\.merge_target_rank = 1"):
        ss.ShampooConfig(spectral=ss.SpectralDescentConfig())
    with pytest.raises(ValueError, match=r"ShampooConfig\.spectral"):
        ss.ShampooConfig(spectral=ss.SpectralDescentConfig(),
                         diagonal=ss.DiagonalPreconditionerConfig(),
                         blocking=ss.BlockingConfig(merge_target_rank=2))
    assert ss.ShampooConfig.from_dict(ns.to_dict()) == ns  # coefficients back to a tuple


def test_meta_eigendecomposed_shampoo_is_the_eigh_root() -> None:
    """EigendecomposedShampooPreconditionerConfig: eq. (10)'s root from a stored
    eigendecomposition, read as RootInv's eigh root; narrower eigendecomposition dtypes
    are refused, naming the key (its QR refresh: the next test)."""
    kind = "EigendecomposedShampooPreconditionerConfig"
    stab = {"type": "PerturbationConfig", "perturb_before_computation": False}
    for extra in ({}, {"inverse_exponent_override": {2: 0.25}},
                  {"amortized_computation_config": {"type": "EighEigendecompositionConfig",
                                                    "rank_deficient_stability_config": stab}}):
        root_inv = {**extra, "type": "RootInvShampooPreconditionerConfig"}
        if "amortized_computation_config" in extra:
            root_inv["amortized_computation_config"] = {
                "type": "EigenConfig", "rank_deficient_stability_config": stab}
        assert (ss.from_meta({"preconditioner_config": {**extra, "type": kind}})
                == ss.from_meta({"preconditioner_config": root_inv}))
    with pytest.raises(NotImplementedError, match=r"factor_matrix_eigenvectors_dtype = 'float32'"):
        ss.from_meta({"preconditioner_config": {"type": kind, "factor_matrix_dtype": "float64"}})
    with pytest.raises(ValueError, match=r"factor_matrix_eigenvalues_dtype = 'float64' is invalid"):
        ss.from_meta({"preconditioner_config": {
            "type": "RootInvShampooPreconditionerConfig",
            "factor_matrix_eigenvalues_dtype": "float64"}})
    with pytest.raises(ValueError, match=r"inv_factor_matrix_dtype = 'float64' is invalid"):
        ss.from_meta({"preconditioner_config": {"type": kind,
                                                "inv_factor_matrix_dtype": "float64"}})


def test_meta_eigendecomposed_qr_is_the_qr_root() -> None:
    """QREigendecompositionConfig with Eigendecomposed (and KL) Shampoo: the eigh root with
    ``eigenbasis_method="qr"`` (eq. 10f), its max_iterations and tolerance, the epsilon
    rule read as eigh's; to_meta writes it back; to_google names it as lacking."""
    kind = "EigendecomposedShampooPreconditionerConfig"
    qr = {"type": "QREigendecompositionConfig", "max_iterations": 4, "tolerance": 0.02}
    got = ss.from_meta({"preconditioner_config": {"type": kind,
                                                  "amortized_computation_config": qr}})
    plain = ss.from_meta({"preconditioner_config": {"type": kind}})
    assert got == dataclasses.replace(plain, root_inverse=ss.EighConfig(
        eigenbasis_method="qr", qr_max_iterations=4, qr_tolerance=0.02))
    assert ss.from_meta({"preconditioner_config": {"type": kind, "amortized_computation_config": {
        "type": "QREigendecompositionConfig"}}}).root_inverse == ss.EighConfig(
            eigenbasis_method="qr")  # Meta's defaults: 1 iteration, tolerance 0
    after = {**qr, "rank_deficient_stability_config": {
        "type": "PerturbationConfig", "perturb_before_computation": False}}
    shifted = ss.from_meta({"preconditioner_config": {"type": kind,
                                                      "amortized_computation_config": after}})
    assert shifted.epsilon.placement == "shift_after" and shifted.root_inverse.qr
    pseudo = {**qr, "rank_deficient_stability_config": {"type": "PseudoInverseConfig"}}
    pinv = ss.from_meta({"epsilon": 0.0, "preconditioner_config": {
        "type": kind, "amortized_computation_config": pseudo}})
    assert pinv.epsilon.placement == "pseudo_inverse" and pinv.root_inverse.qr
    kl = ss.from_meta({"preconditioner_config": {
        "type": "EigendecomposedKLShampooPreconditionerConfig",
        "amortized_computation_config": qr}})
    assert kl.statistics.kl and kl.root_inverse == got.root_inverse
    for config in (got, shifted, pinv, kl):
        exported = ss.to_meta(config)
        assert exported["preconditioner_config"]["amortized_computation_config"]["type"] == (
            "QREigendecompositionConfig")
        assert ss.from_meta(exported) == config
    assert ss.to_meta(kl)["preconditioner_config"]["type"] == (
        "EigendecomposedKLShampooPreconditionerConfig")
    with pytest.raises(ss.Inexpressible, match=r"root_inverse\.eigenbasis_method = 'qr'"):
        ss.to_google(got)
    with pytest.raises(ValueError, match=r"tolerance = 2\.0 is invalid"):
        ss.from_meta({"preconditioner_config": {"type": kind, "amortized_computation_config": {
            "type": "QREigendecompositionConfig", "tolerance": 2}}})
    with pytest.raises(ValueError, match=r"max_iterations = -1"):
        ss.from_meta({"preconditioner_config": {"type": kind, "amortized_computation_config": {
            "type": "QREigendecompositionConfig", "max_iterations": -1}}})


def test_qr_root_config_rules() -> None:
    """Eq. (10f)'s fields are refused, by name, where they mean nothing or are not
    specified."""
    qr = ss.EighConfig(eigenbasis_method="qr")
    with pytest.raises(ValueError, match=r"root_inverse\.qr_max_iterations = 3"):
        ss.EighConfig(qr_max_iterations=3)
    with pytest.raises(ValueError, match=r"root_inverse\.qr_tolerance = 0\.1"):
        ss.EighConfig(qr_tolerance=0.1)
    with pytest.raises(ValueError, match=r"root_inverse\.failure_threshold = 0\.1"):
        ss.EighConfig(eigenbasis_method="qr", failure_threshold=0.1)
    with pytest.raises(ValueError, match=r"root_inverse\.eigenbasis_method = 'lanczos'"):
        ss.EighConfig(eigenbasis_method="lanczos")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"ShampooConfig\.eigenvalue_correction"):
        ss.ShampooConfig(root_inverse=qr, eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    with pytest.raises(ValueError, match=r"ShampooConfig\.inverse_root_dtype = 'bfloat16'"):
        ss.ShampooConfig(root_inverse=qr, inverse_root_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"ShampooConfig\.low_rank"):
        ss.ShampooConfig(root_inverse=qr, low_rank=ss.LowRankRootConfig(rank=2))
    with pytest.raises(ValueError, match=r"epsilon\.placement = 'ridge_floor'"):
        ss.ShampooConfig(root_inverse=qr, epsilon=ss.EpsilonConfig(placement="ridge_floor"))
    config = ss.ShampooConfig(root_inverse=qr)
    assert config.root_inverse_qr and ss.ShampooConfig.from_dict(config.to_dict()) == config


def test_meta_kl_shampoo() -> None:
    """Eq. (6b): Meta's KL classes are their base class with statistics.kl."""
    for kl, base in (("RootInvKLShampooPreconditionerConfig",
                      "RootInvShampooPreconditionerConfig"),
                     ("EigendecomposedKLShampooPreconditionerConfig",
                      "EigendecomposedShampooPreconditionerConfig")):
        got = ss.from_meta({"preconditioner_config": {"type": kl}, "betas": [0.0, 0.99]})
        want = ss.from_meta({"preconditioner_config": {"type": base}, "betas": [0.0, 0.99]})
        assert got.statistics.kl and got == dataclasses.replace(
            want, statistics=dataclasses.replace(want.statistics, kl=True))
        assert ss.from_meta(ss.to_meta(got)) == ss.from_meta(
            {"preconditioner_config": {"type": "RootInvKLShampooPreconditionerConfig"},
             "betas": [0.0, 0.99]})
    with pytest.raises(NotImplementedError, match=r"inv_factor_matrix_dtype = 'float32'"):
        ss.from_meta({"preconditioner_config": {"type": "RootInvKLShampooPreconditionerConfig",
                                                "factor_matrix_dtype": "float64"}})
    with pytest.raises(NotImplementedError, match="perturb_before_computation = False"):
        ss.from_meta({"preconditioner_config": {
            "type": "EigendecomposedKLShampooPreconditionerConfig",
            "amortized_computation_config": {
                "type": "EighEigendecompositionConfig", "rank_deficient_stability_config": {
                    "type": "PerturbationConfig", "perturb_before_computation": False}}}})
    with pytest.raises(ValueError, match=r"ShampooConfig\.inverse_root_dtype = 'float32' is "
                                         r"invalid: allowed None with statistics\.kl"):
        ss.ShampooConfig(statistics=ss.StatisticsConfig(kl=True),
                         inverse_root_dtype="float32")


def test_diagonal_refuses_kronecker_options() -> None:
    """Eq. (16b) keeps no factors: options of theirs are refused, naming the field."""
    d = ss.DiagonalPreconditionerConfig()
    with pytest.raises(ValueError, match=r"ShampooConfig\.inverse_root_dtype = 'float32'"):
        ss.ShampooConfig(diagonal=d, inverse_root_dtype="float32")
    with pytest.raises(ValueError, match=r"ShampooConfig\.eigenvalue_correction"):
        ss.ShampooConfig(diagonal=d, eigenvalue_correction=ss.EigenvalueCorrectionConfig())
    with pytest.raises(ValueError, match=r"statistics\.storage"):
        ss.ShampooConfig(diagonal=d, root_inverse=ss.CoupledNewtonConfig(),
                         statistics=ss.StatisticsConfig(storage="int16_columnwise_diagonal"))
    with pytest.raises(ValueError, match=r"diagonal\.beta2 = 0\.9 is invalid: allowed 1\.0 "
                                         r"for diagonal type 'adagrad'"):
        ss.DiagonalPreconditionerConfig(type="adagrad", beta2=0.9)
    with pytest.raises(ValueError, match=r"diagonal\.type = 'lion'"):
        ss.DiagonalPreconditionerConfig(type="lion")  # type: ignore[arg-type]
    c = ss.ShampooConfig(diagonal=ss.DiagonalPreconditionerConfig(type="rmsprop", beta2=0.9))
    assert ss.ShampooConfig.from_dict(c.to_dict()) == c


def test_meta_gradient_filter() -> None:
    assert meta._gradient_filter(SHARED) == ss.GradientFilterConfig(
        beta1=0.9, beta3=None, bias_correction=True
    )
    f = meta._gradient_filter(SHARED._replace(beta1=0.0, beta3=0.5, bias_correction=False))
    assert f == ss.GradientFilterConfig(beta1=0.0, beta3=0.5, bias_correction=False)


# ------------------------------------------------------------------ Google
def test_google_require_and_unsupported() -> None:
    google._require(g(learning_rate=0.1), "learning_rate")
    with pytest.raises(ValueError, match="block_size is required"):
        google._require(g(learning_rate=0.1), "block_size")
    google._unsupported(g(**{key: default
                             for key, (default, _) in google_keys.UNSUPPORTED.items()}))


def test_google_imports_every_key() -> None:
    """At 239a8cd nothing of Google's distributed_shampoo is refused for itself (only
    the combinations :func:`google._unsupported` and ``_deflation`` name)."""
    assert google_keys.UNSUPPORTED == {}


def test_google_lobpcg_is_deflation_of_the_newton_root() -> None:
    """Eq. (11d): lobpcg_topk_precondition k -> deflation_rank, lobpcg_max_iter m ->
    deflation_iterations (0: k, as Google's; < 0: none, as its loop runs); no effect on
    the eigh path or at k <= 0 (Google's ``if lobpcg_topk_precondition > 0``)."""
    def root(**kw: object) -> object:
        return google_pre._preconditioner(g(**kw), 0.999, True).root_inverse
    newton = root(lobpcg_topk_precondition=3)
    assert isinstance(newton, ss.CoupledNewtonConfig)
    assert (newton.deflation_rank, newton.deflation_iterations) == (3, None)
    assert newton.lobpcg_iterations == 3
    assert root(lobpcg_topk_precondition=3, lobpcg_max_iter=12).deflation_iterations == 12
    assert root(lobpcg_topk_precondition=3, lobpcg_max_iter=-2).deflation_iterations == 0
    plain = ss.CoupledNewtonConfig(max_iterations=100, tolerance=1e-6, error_growth_limit=1.2,
                                   retries=5, retry_epsilon_factor=10.0,
                                   retry_error_threshold=0.05, failure_threshold=0.1)
    assert root(lobpcg_topk_precondition=0, lobpcg_max_iter=5) == plain
    assert root(lobpcg_topk_precondition=-4) == plain
    assert root(lobpcg_topk_precondition=3, eigh=True) == ss.EighConfig(failure_threshold=0.1)
    with pytest.raises(ValueError, match=r"lobpcg_max_iter = 10001 is invalid"):
        root(lobpcg_topk_precondition=3, lobpcg_max_iter=10_001)
    with pytest.raises(ValueError, match=r"lobpcg_topk_precondition = 1.5 is invalid"):
        root(lobpcg_topk_precondition=1.5)


def test_google_grafting() -> None:
    sgd = google._grafting(g(), 0.999, True)
    assert sgd == ss.GraftingConfig(type="sgd", beta2=1.0, epsilon=1e-10, norm_scope="parameter",
                                    norm_epsilon=1e-25, normalize_epsilon=1e-25)
    rms = google._grafting(g(graft_type="RMSPROP", diagonal_epsilon=1e-8), 0.9, True)
    assert (rms.type, rms.beta2, rms.epsilon, rms.bias_correction) == ("rmsprop", 0.9, 1e-8, False)
    assert google._grafting(g(graft_type="RMSPROP"), 1.0, True).type == "adagrad"
    assert google._grafting(g(graft_type="RMSPROP_NORMALIZED"), 1.0, True).type == (
        "adagrad_normalized"
    )
    assert google._grafting(g(graft_type="SQRT_N"), 0.999, True).type == "sign"
    assert google._grafting(g(graft_type="ADAGRAD"), 0.9, True).beta2 == 1.0
    assert google._grafting(g(graft_type="NONE"), 0.999, True).type == "none"
    with pytest.raises(NotImplementedError, match="decoupled_learning_rate = False"):
        google._grafting(g(graft_type="NONE"), 0.999, False)
    with pytest.raises(ValueError, match="graft_type = 'ADAM' is invalid"):
        google._grafting(g(graft_type="ADAM"), 0.999, True)
    # Eq. (14d): Google clips the RMSPROP grafts only, and only with a nonzero value.
    clip = {"clip_by_scaled_gradient_norm": 0.5}
    for name in ("RMSPROP", "RMSPROP_NORMALIZED"):
        assert google._grafting(g(graft_type=name, **clip), 0.9, True).clip_rms == 0.5
        assert google._grafting(g(graft_type=name, **clip), 1.0, True).clip_rms == 0.5  # AdaGrad
        assert google._grafting(g(graft_type=name, clip_by_scaled_gradient_norm=0),
                                0.9, True).clip_rms is None
    for name in ("SGD", "ADAGRAD", "ADAGRAD_NORMALIZED", "SQRT_N", "NONE"):
        assert google._grafting(g(graft_type=name, **clip), 0.9, True).clip_rms is None
    with pytest.raises(ValueError, match="clip_by_scaled_gradient_norm = -1.0"):
        google._grafting(g(graft_type="RMSPROP", clip_by_scaled_gradient_norm=-1.0), 0.9, True)
    with pytest.raises(ValueError, match="clip_by_scaled_gradient_norm = 'x'"):
        google._grafting(g(graft_type="RMSPROP", clip_by_scaled_gradient_norm="x"), 0.9, True)


def test_google_preconditioner() -> None:
    p = google_pre._preconditioner(g(), 0.95)
    assert p.statistics == ss.StatisticsConfig(beta2=0.95, bias_correction=False,
                                               initial_value="epsilon_identity")
    assert p.epsilon == ss.EpsilonConfig(value=1e-6, scale="relative", relative_floor=1e-25,
                                         placement="ridge_floor", lambda_max="power_iteration")
    assert isinstance(p.root_inverse, ss.CoupledNewtonConfig)
    assert (p.root_inverse.retries, p.root_inverse.failure_threshold) == (5, 0.1)
    assert p.exponents == ss.ExponentConfig(default="preconditioned_dims", override=0.0)
    e = google_pre._preconditioner(g(eigh=True, relative_matrix_epsilon=False, matrix_epsilon=1e-4,
                                 exponent_override=4), 0.95)
    # Google judges eigh roots by inverse_failure_threshold too (eq. 13), default 0.1.
    assert e.root_inverse == ss.EighConfig(failure_threshold=0.1) and e.exponents.override == 4.0
    assert (e.epsilon.value, e.epsilon.scale, e.epsilon.relative_floor) == (1e-4, "absolute", 1e-6)
    strict = google_pre._preconditioner(g(eigh=True, inverse_failure_threshold=1e-30), 0.95)
    assert strict.root_inverse == ss.EighConfig(failure_threshold=1e-30)
    assert google_pre._preconditioner(g(exponent_override=-2), 0.95).exponents.override == 0.0
    # Eq. (20c): int16 statistics and roots with best_effort and a pmap axis, in Google's dtype.
    q = google_pre._preconditioner(g(best_effort_memory_usage_reduction=True, batch_axis_name="b"),
                               0.95, x64=False).statistics
    assert q.storage == "int16_columnwise_diagonal" and q.scale_dtype == "float32"
    assert not google_pre._preconditioner(g(best_effort_memory_usage_reduction=True),
                                      0.95).statistics.quantized
    with pytest.raises(ValueError, match="matrix_epsilon = 'small'"):
        google_pre._preconditioner(g(matrix_epsilon="small"), 0.95)
    with pytest.raises(ValueError, match="root_inverse.failure_threshold"):
        google_pre._preconditioner(g(inverse_failure_threshold=0), 0.95)
    with pytest.raises(ValueError, match=r"root_inverse.failure_threshold = 0.0 .*2\^-126"):
        google_pre._preconditioner(g(eigh=True, inverse_failure_threshold=0), 0.95)


def test_google_compression_rank_is_low_rank_roots() -> None:
    """Eq. (10c): |compression_rank| kept eigenvalues, the largest when it is positive, the
    root judged at inverse_failure_threshold and lambda_max floored at 1e-6 (the eigh
    path's floor already: then no floor of its own)."""
    assert google_pre._preconditioner(g(), 0.95).low_rank is None
    newton = google_pre._preconditioner(g(compression_rank=3, inverse_failure_threshold=0.5), 0.95)
    assert newton.low_rank == ss.LowRankRootConfig(rank=3, keep="largest", failure_threshold=0.5,
                                                   relative_floor=1e-6)
    assert newton.epsilon.relative_floor == 1e-25  # the Newton roots' own
    eigh = google_pre._preconditioner(g(compression_rank=-4, eigh=True), 0.95)
    assert eigh.low_rank == ss.LowRankRootConfig(rank=4, keep="smallest", failure_threshold=0.1)
    assert eigh.low_rank.epsilon_for(eigh.epsilon).relative_floor == 1e-6
    # Google turns its int16 statistics off with compression (the momentum stays int8).
    q = google_pre._preconditioner(g(best_effort_memory_usage_reduction=True, batch_axis_name="b",
                                 compression_rank=2), 0.95)
    assert not q.statistics.quantized
    with pytest.raises(ValueError, match="compression_rank = 2.5"):
        google_pre._preconditioner(g(compression_rank=2.5), 0.95)


def test_google_frequent_directions_are_sketches() -> None:
    """Eqs. (6c), (10d): compression_rank sketches the factors (no low-rank root then),
    average_grad averages the statistics gradient, Google's floor 1e-6; Google's own
    refusals are kept, and FD without reuse_preconditioner (Google crashes) is refused."""
    fd = {"frequent_directions": True, "compression_rank": 3, "reuse_preconditioner": True}
    pre = google_pre._preconditioner(g(**fd, average_grad=True), 0.95)
    assert pre.low_rank is None
    assert pre.frequent_directions == ss.FrequentDirectionsConfig(
        rank=3, average_gradients=True, reset_every=None, relative_floor=1e-6,
        packing="google")  # Google's packing at the largest statistic's size (eq. 10d)
    # Google turns its int16 statistics off with frequent directions.
    q = google_pre._preconditioner(g(**fd, best_effort_memory_usage_reduction=True,
                                 batch_axis_name="b"), 0.95)
    assert not q.statistics.quantized
    for bad, message in [
        ({**fd, "compression_rank": -3}, "requires compression_rank > 0, found -3"),
        ({**fd, "compression_rank": 0}, "requires compression_rank > 0, found 0"),
        ({**fd, "reuse_preconditioner": False}, "requires reuse_preconditioner = true"),
        ({**fd, "statistics_compute_steps": 2},
         r"statistics_compute_steps \(2\) = preconditioning_compute_steps \(1\)"),
        ({"average_grad": True}, "average_grad = true requires frequent_directions"),
        ({**fd, "average_grad": 1}, "average_grad = 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            google_pre._preconditioner(g(**bad), 0.95)


def test_google_reset_preconditioner_is_a_reset_period_with_beta2_one() -> None:
    """Google empties the sketch every round(1 / (1 - beta2)) steps and runs with beta2 = 1
    everywhere (statistics, sketch, RMSPROP graft: AdaGrad then)."""
    fd = {"learning_rate": 0.1, "block_size": 8, "frequent_directions": True,
          "compression_rank": 2, "reuse_preconditioner": True}
    c = ss.from_google({**fd, "reset_preconditioner": True, "beta2": 0.9,
                        "graft_type": "RMSPROP"})
    assert c.frequent_directions is not None and c.frequent_directions.reset_every == 10
    assert c.statistics.beta2 == 1.0 and c.grafting.type == "adagrad"
    assert ss.from_google({**fd, "reset_preconditioner": True, "beta2": 0.95}
                          ).frequent_directions.reset_every == 20  # type: ignore[union-attr]
    # beta2 = 1: Google never resets (its period is None).
    one = ss.from_google({**fd, "reset_preconditioner": True, "beta2": 1.0})
    assert one.frequent_directions is not None and one.frequent_directions.reset_every is None
    with pytest.raises(ValueError, match="reset_preconditioner = true requires frequent_dir"):
        ss.from_google({"learning_rate": 0.1, "block_size": 8, "reset_preconditioner": True})
    with pytest.raises(ValueError, match="exceeds 2147483647"):
        ss.from_google({**fd, "reset_preconditioner": True, "beta2": 1 - 1e-12})


def test_google_fd_metrics_without_frequent_directions_change_nothing() -> None:
    google._no_numerical_effect(g(generate_fd_metrics=True))
    with pytest.raises(ValueError, match="generate_fd_metrics = 1"):
        google._no_numerical_effect(g(generate_fd_metrics=1))


def test_google_momentum() -> None:
    assert google._momentum(g(), "sgd", True, None) == ss.MomentumConfig(
        momentum=0.9, dampening=0.0, nesterov=True, buffers="separate",
        learning_rate_placement="after_momentum",
    )
    # No graft: still two buffers (the Shampoo direction, and Google's SGD warm-up's;
    # the digits anchors' no_graft_momentum_delayed_start case runs Google's library).
    assert google._momentum(g(), "none", True, None).buffers == "separate"
    assert google._momentum(g(beta1=0.0), "sgd", True, None).buffers == "shared"
    c = google._momentum(g(moving_average_for_momentum=True, nesterov=False), "sgd", False, None)
    assert (c.dampening, c.nesterov, c.learning_rate_placement) == (0.9, False, "before_momentum")
    # Eq. (20b): int8 momentum, scales in the dtype Google computes in.
    q = google._momentum(g(best_effort_memory_usage_reduction=True), "sgd", True, False)
    assert (q.storage, q.scale_dtype) == ("int8_columnwise", "float32")
    q = google._momentum(g(best_effort_memory_usage_reduction=True), "sgd", True, None)
    assert (q.storage, q.scale_dtype) == ("int8_columnwise", "float64")
    with pytest.raises(ValueError, match="best_effort_memory_usage_reduction = 1"):
        google._momentum(g(best_effort_memory_usage_reduction=1), "sgd", True, None)
    with pytest.raises(ValueError, match="momentum.momentum = 1.5"):
        google._momentum(g(beta1=1.5), "sgd", True, None)


def test_google_weight_decay() -> None:
    assert google._weight_decay(g()) == ss.WeightDecayConfig(value=0.0, type="direction")
    assert google._weight_decay(g(weight_decay=0.1, decoupled_weight_decay=True)) == (
        ss.WeightDecayConfig(value=0.1, type="update")
    )
    with pytest.raises(ValueError, match="weight_decay = 'x'"):
        google._weight_decay(g(weight_decay="x"))


def test_google_blocking() -> None:
    assert google._blocking(g(block_size=128)) == ss.BlockingConfig(
        max_preconditioner_dim=128, merge_dims_up_to=4096, merge_direction="first_to_last",
        skip_dim_size_gt=4096, skip_rank_lt=1, preconditioned_dims="all",
    )
    b = google._blocking(g(block_size=0, skip_preconditioning_dim_size_gt="inf",
                           merge_small_dims_block_size=1, preconditioner_type="INPUT"))
    assert b.max_preconditioner_dim == b.skip_dim_size_gt == _parse.UNBOUNDED
    assert (b.merge_dims_up_to, b.preconditioned_dims) == (1, "all_but_last")
    # Google's own misspelling is accepted.
    assert google._blocking(g(block_size=8, precondtioner_type="OUTPUT")).preconditioned_dims == (
        "last"
    )
    with pytest.raises(ValueError, match="preconditioner_type = 'BOTH'"):
        google._blocking(g(block_size=8, preconditioner_type="BOTH"))
    scalar = google._blocking(g(block_size=8, skip_preconditioning_rank_lt=0))
    assert (scalar.skip_rank_lt, scalar.scalar_factor) == (0, False)
    with pytest.raises(ValueError, match="merge_small_dims_block_size = 0"):
        google._blocking(g(block_size=8, merge_small_dims_block_size=0))
    with pytest.raises(ValueError, match="block_size = None"):
        google._blocking(g())


def test_google_schedule() -> None:
    assert google._schedule(g()) == ss.ScheduleConfig(
        precondition_frequency=1, statistics_frequency=1, start_preconditioning_step=6,
        period_anchor="start", roots_before_start=True,
    )
    s = google._schedule(g(start_preconditioning_step=0, preconditioning_compute_steps=10,
                           statistics_compute_steps=2))
    assert (s.start_preconditioning_step, s.precondition_frequency, s.statistics_frequency) == (
        1, 10, 2
    )
    with pytest.raises(ValueError, match="statistics_compute_steps = 'x'"):
        google._schedule(g(statistics_compute_steps="x"))
    # Eq. (8b): Google's decay acts only with a flag, a nonzero end and a callable rate.
    decay = {"decay_preconditioning_compute_steps": True, "end_preconditioning_compute_steps": 20}
    assert google._schedule(g(**decay), scheduled_lr=True).precondition_frequency_growth == 20
    assert google._schedule(g(**decay)).precondition_frequency_growth is None
    off = [{**decay, "decay_preconditioning_compute_steps": False},
           {**decay, "end_preconditioning_compute_steps": 0},
           {**decay, "end_preconditioning_compute_steps": None}]
    for kwargs in off:
        schedule = google._schedule(g(**kwargs), scheduled_lr=True)
        assert schedule.precondition_frequency_growth is None
    with pytest.raises(ValueError, match="end_preconditioning_compute_steps = -10"):
        google._schedule(g(end_preconditioning_compute_steps=-10))
    with pytest.raises(ValueError, match="decay_preconditioning_compute_steps = 1"):
        google._schedule(g(decay_preconditioning_compute_steps=1))


def test_google_sharded_states_take_roots_effect_next_step() -> None:
    """shard_optimizer_states: the step's direction uses the roots in the state (eq. 8)."""
    assert google._schedule(g()).roots_take_effect == "same_step"
    lagged = google._schedule(g(shard_optimizer_states=True, num_devices_for_pjit=8))
    assert lagged.roots_take_effect == "next_step"
    assert google._schedule(g(shard_optimizer_states=False, num_devices_for_pjit=8)) == (
        google._schedule(g())
    )
    with pytest.raises(ValueError, match="num_devices_for_pjit = None is invalid: allowed a "
                       "positive integer with shard_optimizer_states = true"):
        google._schedule(g(shard_optimizer_states=True))
    with pytest.raises(ValueError, match="num_devices_for_pjit = 0 is invalid"):
        google._schedule(g(shard_optimizer_states=True, num_devices_for_pjit=0))
    with pytest.raises(ValueError, match="shard_optimizer_states = 'yes' is invalid"):
        google._schedule(g(shard_optimizer_states="yes", num_devices_for_pjit=1))
