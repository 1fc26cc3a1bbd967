"""Meta ``DistributedShampoo`` argument sets (JSON form) that both checks of Meta's rules run.

``reference/tests/anchors/test_reference_matches_meta.py`` runs each through
``from_meta`` on the reference and through an independent float64 emulator
of Meta's library; ``anchors/test_meta_library.py`` runs each on Meta's real
library and on ``shampoo_torch``. One list, so the two checks cover the same
rules.
"""

from __future__ import annotations

from typing import Any

ADAGRAD = {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-10}
#: float64 factors and roots: the emulator computes in float64 throughout (Meta's
#: default float32 roots would import as inverse_root_dtype="float32", eq. 11a).
EIGEN64 = {
    "type": "RootInvShampooPreconditionerConfig",
    "amortized_computation_config": {"type": "EigenConfig"},
    "factor_matrix_dtype": "float64",
    "inv_factor_matrix_dtype": "float64",
}

META_CASES: dict[str, dict[str, Any]] = {
    "defaults_adagrad": {"grafting_config": ADAGRAD, "epsilon": 1e-6},
    "no_graft": {"epsilon": 1e-4},
    "sgd_graft": {"grafting_config": {"type": "SGDPreconditionerConfig"}, "epsilon": 1e-6},
    "rmsprop_graft": {
        "grafting_config": {"type": "RMSpropPreconditionerConfig", "beta2": 0.95},
        "epsilon": 1e-6,
    },
    "adam_graft_ema": {
        "grafting_config": {"type": "AdamPreconditionerConfig", "beta2": 0.99, "epsilon": 1e-8},
        "betas": [0.9, 0.95],
        "epsilon": 1e-6,
    },
    "beta3_nadam": {"grafting_config": ADAGRAD, "betas": [0.9, 0.99], "beta3": 0.5},
    "no_bias_correction": {
        "grafting_config": ADAGRAD,
        "betas": [0.0, 0.9],
        "use_bias_correction": False,
        "epsilon": 1e-6,
    },
    "l2": {"grafting_config": ADAGRAD, "weight_decay": 0.05, "weight_decay_type": "L2"},
    "decoupled_momentum_nesterov": {
        "grafting_config": ADAGRAD,
        "weight_decay": 0.05,
        "weight_decay_type": "DECOUPLED",
        "iterate_averaging_config": {
            "type": "ClassicMomentumConfig",
            "momentum": 0.9,
            "dampening": 0.1,
            "use_nesterov": True,
        },
    },
    "momentum_plain": {
        "grafting_config": ADAGRAD,
        "iterate_averaging_config": {"type": "ClassicMomentumConfig", "momentum": 0.5},
    },
    "frequency_delayed_start": {
        "grafting_config": ADAGRAD,
        "precondition_frequency": 3,
        "start_preconditioning_step": 5,
        "epsilon": 1e-6,
    },
    "coupled_newton": {
        "grafting_config": ADAGRAD,
        "epsilon": 1e-4,
        "preconditioner_config": {
            "type": "RootInvShampooPreconditionerConfig",
            "amortized_computation_config": {
                "type": "CoupledNewtonConfig",
                "max_iterations": 100,
                "tolerance": 1e-12,
            },
            "factor_matrix_dtype": "float64",
            "inv_factor_matrix_dtype": "float64",
        },
    },
    "no_merge_small_blocks": {
        "grafting_config": ADAGRAD,
        "max_preconditioner_dim": 4,
        "epsilon": 1e-4,
    },
    "exponent_override": {
        "grafting_config": ADAGRAD,
        "max_preconditioner_dim": 8,
        "epsilon": 1e-4,
        "preconditioner_config": {
            **EIGEN64,
            "inverse_exponent_override": {"2": {"0": 0.5, "1": 0.0}, "1": 0.25},
        },
    },
    "perturb_after": {
        "grafting_config": ADAGRAD,
        "epsilon": 1e-5,
        "preconditioner_config": {
            **EIGEN64,
            "amortized_computation_config": {
                "type": "EigenConfig",
                "rank_deficient_stability_config": {
                    "type": "PerturbationConfig",
                    "perturb_before_computation": False,
                },
            },
        },
    },
    "eigenvalue_corrected": {
        "grafting_config": ADAGRAD,
        "betas": [0.9, 0.95],
        "epsilon": 1e-8,
        "max_preconditioner_dim": 8,
        # First eigenbasis at step 9, when every (<= 8)-dim factor has full rank: a
        # degenerate eigenspace would make the basis (and D) arbitrary in both.
        "precondition_frequency": 9,
        "preconditioner_config": {
            "type": "EigenvalueCorrectedShampooPreconditionerConfig",
            "amortized_computation_config": {"type": "EighEigendecompositionConfig"},
        },
    },
    "independent_decay": {
        "grafting_config": ADAGRAD,
        "lr": 0.05,
        "weight_decay": 0.01,
        "weight_decay_type": "INDEPENDENT",
    },
}


__all__ = ["ADAGRAD", "EIGEN64", "META_CASES"]
