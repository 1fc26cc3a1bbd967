"""Meta's and Google's argument sets (JSON form) that both checks of each library's rules run.

``reference/tests/anchors/test_reference_matches_meta.py`` runs each Meta set through
``from_meta`` on the reference and through an independent float64 emulator
of Meta's library; ``anchors/test_meta_library.py`` runs each on Meta's real
library and on ``shampoo_torch``; the ``meta`` conformance backend on the suite's
named problem. The same for Google's sets (:data:`GOOGLE_CASES`). One list per
library, so the checks cover the same rules.
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


#: Google ``distributed_shampoo`` argument sets (JSON form), over a base of the caller's
#: (learning rate, block size, epsilon rule): ``anchors/test_google_library.py`` runs each
#: on Google's real library and on ``shampoo_jax`` (digits MLP, 50 steps);
#: ``reference/tests/anchors/test_reference_matches_google.py`` on the reference and the
#: emulator (with its overrides, named there); the ``google`` conformance backend on the
#: suite's named problem.
GOOGLE_CASES: dict[str, dict[str, Any]] = {
    "defaults_sgd": {},
    "adagrad": {"graft_type": "ADAGRAD"},
    "rmsprop": {"graft_type": "RMSPROP", "beta2": 0.95},
    "rmsprop_normalized": {"graft_type": "RMSPROP_NORMALIZED", "beta2": 0.95},
    "adagrad_normalized": {"graft_type": "ADAGRAD_NORMALIZED"},
    "sign": {"graft_type": "SQRT_N"},
    # lr 0.001: with no graft the Shampoo direction is unscaled; at 0.01 the loss rises.
    "no_graft": {"graft_type": "NONE", "start_preconditioning_step": 0, "learning_rate": 0.001},
    "no_nesterov_moving_average": {
        "graft_type": "ADAGRAD",
        "nesterov": False,
        "moving_average_for_momentum": True,
    },
    "frequency_delayed_start": {
        "graft_type": "ADAGRAD",
        "preconditioning_compute_steps": 3,
        "statistics_compute_steps": 2,
        "start_preconditioning_step": 4,
    },
    # matrix_epsilon 1e-4: BASE already makes every case absolute; this one varies the value.
    "absolute_epsilon": {
        "graft_type": "ADAGRAD",
        "relative_matrix_epsilon": False,
        "matrix_epsilon": 1e-4,
    },
    "eigh": {"graft_type": "ADAGRAD", "eigh": True},
    "no_merge_blocked": {
        "graft_type": "ADAGRAD",
        "merge_small_dims_block_size": 1,
        "block_size": 4,
    },
    # 16, not 6 (every dim of this model exceeds 6): skips the (64, 16) weight only.
    "skip_large_dims": {"graft_type": "ADAGRAD", "skip_preconditioning_dim_size_gt": 16},
    "exponent_override": {"graft_type": "ADAGRAD", "exponent_override": 4},
    "output_side": {
        "graft_type": "ADAGRAD",
        "merge_small_dims_block_size": 1,
        "preconditioner_type": "OUTPUT",
    },
    "coupled_weight_decay": {"graft_type": "ADAGRAD", "weight_decay": 0.05},
    "decoupled_weight_decay": {
        "graft_type": "ADAGRAD",
        "weight_decay": 0.05,
        "decoupled_weight_decay": True,
    },
    "coupled_learning_rate": {
        "graft_type": "ADAGRAD",
        "weight_decay": 0.05,
        "decoupled_learning_rate": False,
    },
}


__all__ = ["ADAGRAD", "EIGEN64", "GOOGLE_CASES", "META_CASES"]
