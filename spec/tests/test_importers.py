"""from_meta / from_google: defaults, mappings, and clear errors (the importer contract).

That the imported configs reproduce each library's numerics is tested in
reference/tests/anchors against independent emulators; here we test the
mapping itself and the errors.
"""

from __future__ import annotations

import json

import pytest

import shampoo_spec as ss


def test_meta_defaults() -> None:
    c = ss.from_meta({})
    assert c.learning_rate == 1e-2
    assert c.gradient_filter == ss.GradientFilterConfig(beta1=0.9, beta3=None, bias_correction=True)
    assert c.statistics.beta2 == 1.0 and c.statistics.initial_value == "zero"
    assert c.epsilon == ss.EpsilonConfig(value=1e-12, placement="ridge")
    assert c.schedule.start_preconditioning_step == 1  # -1 -> precondition_frequency
    assert c.blocking.merge_dims_up_to == 1024 and c.blocking.merge_direction == "last_to_first"
    assert c.grafting.type == "none" and c.momentum.momentum == 0.0
    assert c.weight_decay.type == "direction"
    assert c.failure.max_consecutive_root_failures == 3
    assert c.factor_dtype == "float32"


def test_meta_json_forms() -> None:
    c = ss.from_meta(
        json.loads(
            """{
        "lr": 0.5, "betas": [0.0, 0.99], "beta3": 0.5, "epsilon": 1e-8,
        "weight_decay": 0.1, "weight_decay_type": "L2",
        "max_preconditioner_dim": "inf", "precondition_frequency": 10,
        "start_preconditioning_step": 20,
        "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": 0.9},
        "iterate_averaging_config": {"type": "ClassicMomentumConfig", "momentum": 0.9,
                                     "dampening": 0.1, "use_nesterov": true},
        "preconditioner_config": {"type": "RootInvShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "CoupledNewtonConfig", "tolerance": 1e-8},
            "inverse_exponent_override": {"2": {"0": 0.25}, "1": 0.5},
            "factor_matrix_dtype": "torch.float64"}
    }"""
        )
    )
    assert c.weight_decay == ss.WeightDecayConfig(value=0.1, type="l2")
    assert c.grafting.type == "adam" and c.grafting.beta2 == 0.9 and c.grafting.bias_correction
    assert c.momentum == ss.MomentumConfig(momentum=0.9, dampening=0.1, nesterov=True)
    assert isinstance(c.root_inverse, ss.CoupledNewtonConfig)
    assert c.root_inverse.tolerance == 1e-8
    assert c.exponents.overrides_by_order == (
        ss.OrderOverride(order=1, roots=(2.0,)),
        ss.OrderOverride(order=2, roots=(4.0, 4.0)),
    )
    assert c.blocking.max_preconditioner_dim == ss.MAX_INTEGER  # inf: no bound
    assert c.factor_dtype == "float64"
    assert c.gradient_filter.beta3 == 0.5


def test_google_defaults() -> None:
    c = ss.from_google({"learning_rate": 0.1, "block_size": 128})
    assert c.schedule == ss.ScheduleConfig(
        precondition_frequency=1,
        statistics_frequency=1,
        start_preconditioning_step=6,
        period_anchor="start",
        roots_before_start=True,
    )
    assert c.statistics == ss.StatisticsConfig(beta2=0.999, initial_value="epsilon_identity")
    assert c.epsilon.scale == "relative" and c.epsilon.value == 1e-6
    assert c.grafting.type == "sgd" and c.grafting.norm_scope == "parameter"
    assert c.momentum == ss.MomentumConfig(momentum=0.9, nesterov=True, buffers="separate")
    assert c.blocking.skip_dim_size_gt == 4096 and c.blocking.skip_rank_lt == 1
    assert c.blocking.merge_dims_up_to == 4096 and c.blocking.merge_direction == "first_to_last"
    assert isinstance(c.root_inverse, ss.CoupledNewtonConfig)
    assert c.root_inverse.error_growth_limit == 1.2 and c.root_inverse.failure_threshold == 0.1


@pytest.mark.parametrize(
    ("importer", "kwargs", "key"),
    [
        (ss.from_meta, {"iterate_averaging_config": {"type": "PolyakAveragingConfig"}}, "Polyak"),
        (ss.from_meta, {"preconditioner_config": {"type": "KLShampooPreconditionerConfig"}}, "KL"),
        (ss.from_meta, {"preconditioner_config": {"type": "SOAPPreconditionerConfig"}}, "SOAP"),
        (ss.from_meta, {"distributed_config": {"type": "FSDPDistributedConfig"}}, "FSDP"),
        (ss.from_google, {"best_effort_memory_usage_reduction": True, "batch_axis_name": "b",
                          "eigh": True}, "from_google.eigh = True"),
        # No graft: Meta applies the eigenvalue correction from step 1 (identity basis).
        (ss.from_meta, {"precondition_frequency": 5, "preconditioner_config": {
            "type": "EigenvalueCorrectedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "EighEigendecompositionConfig"}}},
         "start_preconditioning_step = 5"),
        (ss.from_meta, {"distributed_config": {
            "type": "DDPDistributedConfig", "communicate_params": True,
            "communication_dtype": "bfloat16"}}, "communicate_params"),
        (ss.from_google, {"best_effort_memory_usage_reduction": True, "batch_axis_name": "b",
                          "shard_optimizer_states": True}, "shard_optimizer_states"),
        (ss.from_google, {"lobpcg_topk_precondition": 4, "batch_axis_name": "b",
                          "best_effort_memory_usage_reduction": True},
         "lobpcg_topk_precondition = 4 with best_effort_memory_usage_reduction"),
        (ss.from_google, {"graft_type": "NONE", "decoupled_learning_rate": False},
         "decoupled_learning_rate"),
    ],
)
def test_unsupported_options_raise_naming_the_key(importer, kwargs, key) -> None:  # type: ignore[no-untyped-def]
    if importer is ss.from_google:
        kwargs = {"learning_rate": 0.1, "block_size": 8, **kwargs}
    with pytest.raises(NotImplementedError, match=key):
        importer(kwargs)


@pytest.mark.parametrize(
    ("importer", "kwargs", "key"),
    [
        (ss.from_meta, {"lrr": 0.1}, "lrr"),
        (ss.from_meta, {"betas": [0.9]}, "betas"),
        (ss.from_meta, {"precondition_frequency": 10, "start_preconditioning_step": 5},
         "start_preconditioning_step"),
        (ss.from_meta, {"weight_decay_type": "SOMETIMES"}, "weight_decay_type"),
        (ss.from_meta, {"grafting_config": "adagrad"}, "grafting_config"),
        (ss.from_meta, {"iterate_averaging_config":
                        {"type": "ClassicMomentumConfig", "momentum": 0.0}}, "momentum"),
        (ss.from_google, {"block_size": 8}, "learning_rate"),
        (ss.from_google, {"learning_rate": 0.1, "block_size": 8, "graft_type": "ADAM"},
         "graft_type"),
        (ss.from_google, {"learning_rate": 0.1, "block_size": 8, "beta1": 1.5}, "momentum"),
    ],
)
def test_malformed_arguments_raise_value_error(importer, kwargs, key) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=key):
        importer(kwargs)
