"""torch's LR schedulers with Shampoo, ``cycle_momentum`` included (docs/integrations.md).

The param groups carry the moments torch's schedulers cycle, named as torch's
optimizers and Meta's DistributedShampoo name them, only where the config keeps
them: ``"betas"`` = (eq. 15's filter beta1, eq. 6's statistics beta2) and
``"momentum"`` = eq. (20)'s mu. The group's beta1 and mu replace the config's at
each step: a changed value equals the float64 reference run with a config holding
it, on both paths (``shampoo_torch.device_path``); OneCycleLR and CyclicLR change
the step exactly as the same values set by hand; every scheduler class of
``torch.optim.lr_scheduler`` runs; bad values are refused before anything changes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from shampoo_reference import run as reference_run
from shampoo_spec import (
    EpsilonConfig,
    GradientFilterConfig,
    GraftingConfig,
    MomentumConfig,
    ShampooConfig,
    StatisticsConfig,
)
from shampoo_torch import Shampoo, device_path

from .helpers import max_relative_error, stream

#: float64 factors: the reference's precision (docs/spec.md section 5, rtol 1e-9).
BASE = ShampooConfig(learning_rate=0.05, epsilon=EpsilonConfig(value=1e-6),
                     statistics=StatisticsConfig(beta2=0.99),
                     grafting=GraftingConfig(type="adagrad"), factor_dtype="float64")
FILTER = dataclasses.replace(BASE, gradient_filter=GradientFilterConfig(beta1=0.9))
FILTER_BIAS = dataclasses.replace(BASE, gradient_filter=GradientFilterConfig(
    beta1=0.9, beta3=0.5, bias_correction=True))
MOMENTUM = dataclasses.replace(BASE, momentum=MomentumConfig(momentum=0.9))
NESTEROV = dataclasses.replace(BASE, momentum=MomentumConfig(
    momentum=0.9, dampening=0.1, nesterov=True, buffers="separate"))
BOTH = dataclasses.replace(FILTER, momentum=MomentumConfig(momentum=0.9))
SHAPES = {"w": (6, 8), "v": (5,), "t": (2, 3, 4)}
STEPS = 10


@pytest.fixture(params=["cpu", "accelerator"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Both paths of every device-dependent choice (:mod:`shampoo_torch.device_path`)."""
    if request.param == "accelerator":
        monkeypatch.setenv(device_path.ENV, "accelerator")
    else:
        monkeypatch.delenv(device_path.ENV, raising=False)
    yield request.param


def _run_with_group(config: ShampooConfig, params: dict[str, np.ndarray],
                    grads: list[dict[str, np.ndarray]], key: str, value: float
                    ) -> list[dict[str, np.ndarray]]:
    """Torch's optimizer in float64 with ``config``, the group's ``key`` set to ``value``
    before the first step; the parameters after each step."""
    tensors = {k: nn.Parameter(torch.tensor(v)) for k, v in params.items()}
    opt = Shampoo(list(tensors.items()), config)
    group = opt.param_groups[0]
    group[key] = (value, *group[key][1:]) if key == "betas" else value
    out = []
    for g in grads:
        for k, t in tensors.items():
            t.grad = torch.tensor(g[k])
        opt.step()
        out.append({k: t.detach().numpy().copy() for k, t in tensors.items()})
    return out


@pytest.mark.parametrize(("config", "key", "value"), [
    (FILTER, "betas", 0.6), (FILTER, "betas", 0.0), (FILTER_BIAS, "betas", 0.7),
    (MOMENTUM, "momentum", 0.5), (MOMENTUM, "momentum", 0.0), (NESTEROV, "momentum", 0.3),
], ids=["filter", "filter_zero", "filter_beta3_bias", "momentum", "momentum_zero",
        "momentum_nesterov_separate"])
def test_a_groups_changed_moment_equals_the_reference_with_that_value(
        path: str, config: ShampooConfig, key: str, value: float) -> None:
    """Eqs. (15), (20): the group's value in place of the config's, bias correction
    included (eq. 15 with beta3), equals the reference run with a config holding it
    (0 turns the config's moment off there: F = G, M = P without dampening)."""
    if key == "betas":
        want = dataclasses.replace(config, gradient_filter=dataclasses.replace(
            config.gradient_filter, beta1=value))
    else:
        want = dataclasses.replace(config, momentum=dataclasses.replace(
            config.momentum, momentum=value))
    params, grads = stream(seed=7, steps=STEPS, shapes=SHAPES)
    ref = reference_run(want, params, grads)
    ours = _run_with_group(config, params, grads, key, value)
    assert max_relative_error(params, ours, ref) <= 1e-9
    unchanged = reference_run(config, params, grads)
    assert max_relative_error(params, unchanged, ref) > 1e-3  # the value mattered


# ---------------------------------------------------------------- schedulers
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1)).double()


def _train(config: ShampooConfig, make: Callable[[Shampoo], Any] | None, steps: int,
           by_hand: list[dict[str, Any]] | None = None
           ) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    """``steps`` steps of a tiny float64 MLP; ``make`` builds a scheduler stepped after
    each step, ``by_hand`` gives the group's lr/betas/momentum before each step instead.
    Returns the parameters and the moment keys of the group at each step."""
    model = _model()
    opt = Shampoo(model.parameters(), config)
    sched = None if make is None else make(opt)
    x = torch.randn(16, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(16, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    seen: list[dict[str, Any]] = []
    for t in range(steps):
        if by_hand is not None:
            opt.param_groups[0].update(by_hand[t])
        seen.append({k: opt.param_groups[0][k] for k in ("lr", "betas", "momentum")
                     if k in opt.param_groups[0]})
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if isinstance(sched, lr_scheduler.ReduceLROnPlateau):
            sched.step(float(loss.detach()))
        elif sched is not None:
            sched.step()
    return [p.detach().clone() for p in model.parameters()], seen


def _one_cycle(cycle: bool) -> Callable[[Shampoo], Any]:
    return lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12,
                                               cycle_momentum=cycle)


def _cyclic(cycle: bool) -> Callable[[Shampoo], Any]:
    return lambda opt: lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.05, step_size_up=3,
                                             cycle_momentum=cycle)


@pytest.mark.parametrize("scheduler", [_one_cycle, _cyclic], ids=["OneCycleLR", "CyclicLR"])
@pytest.mark.parametrize(("config", "key"), [(FILTER, "betas"), (MOMENTUM, "momentum")],
                         ids=["filter", "momentum"])
def test_cycle_momentum_changes_the_step_as_the_values_set_by_hand(
        path: str, scheduler: Callable[[bool], Callable[[Shampoo], Any]],
        config: ShampooConfig, key: str) -> None:
    """With the filter the scheduler cycles ``betas[0]`` (eq. 15), with momentum only
    ``momentum`` (eq. 20): the step differs from the same LR schedule without the
    moment's cycle, and equals the same per-step values set by hand, bit for bit."""
    steps = 10
    got, seen = _train(config, scheduler(True), steps)
    moments = [s[key][0] if key == "betas" else s[key] for s in seen]
    assert len(set(moments)) > 3 and all(0.8 <= m <= 0.95 for m in moments)
    if key == "betas":
        assert all(s["betas"][1] == config.statistics.beta2 for s in seen)
    still, seen_still = _train(config, scheduler(False), steps)
    assert [s["lr"] for s in seen_still] == [s["lr"] for s in seen]
    assert not all(torch.equal(a, b) for a, b in zip(got, still, strict=True))
    by_hand, _ = _train(config, None, steps, seen)
    assert all(torch.equal(a, b) for a, b in zip(got, by_hand, strict=True))


def _every_scheduler() -> dict[str, Callable[[Shampoo], Any]]:
    """A sensible instance of every scheduler class in torch.optim.lr_scheduler, by name."""
    s = lr_scheduler
    return {
        "LambdaLR": lambda o: s.LambdaLR(o, lambda t: 0.9**t),
        "MultiplicativeLR": lambda o: s.MultiplicativeLR(o, lambda t: 0.9),
        "StepLR": lambda o: s.StepLR(o, step_size=2, gamma=0.5),
        "MultiStepLR": lambda o: s.MultiStepLR(o, milestones=[1, 2], gamma=0.5),
        "ConstantLR": lambda o: s.ConstantLR(o, factor=0.5, total_iters=2),
        "LinearLR": lambda o: s.LinearLR(o, start_factor=0.5, total_iters=2),
        "ExponentialLR": lambda o: s.ExponentialLR(o, gamma=0.9),
        "SequentialLR": lambda o: s.SequentialLR(o, [s.ConstantLR(o, factor=0.5, total_iters=1),
                                                     s.ExponentialLR(o, gamma=0.9)],
                                                 milestones=[1]),
        "PolynomialLR": lambda o: s.PolynomialLR(o, total_iters=4, power=2.0),
        "CosineAnnealingLR": lambda o: s.CosineAnnealingLR(o, T_max=3),
        "ChainedScheduler": lambda o: s.ChainedScheduler([s.ConstantLR(o, factor=0.5,
                                                                       total_iters=2),
                                                          s.ExponentialLR(o, gamma=0.9)]),
        "ReduceLROnPlateau": lambda o: s.ReduceLROnPlateau(o, patience=0, factor=0.5),
        "CyclicLR": lambda o: s.CyclicLR(o, base_lr=0.01, max_lr=0.05, step_size_up=2),
        "CosineAnnealingWarmRestarts": lambda o: s.CosineAnnealingWarmRestarts(o, T_0=2),
        "OneCycleLR": lambda o: s.OneCycleLR(o, max_lr=0.05, total_steps=4),
    }


def test_the_test_builds_every_scheduler_torch_has() -> None:
    """A scheduler torch adds fails here until :func:`_every_scheduler` constructs it."""
    classes = {name for name, c in vars(lr_scheduler).items()
               if isinstance(c, type) and issubclass(c, lr_scheduler.LRScheduler)
               and c is not lr_scheduler.LRScheduler and not name.startswith("_")}
    assert classes == set(_every_scheduler())


@pytest.mark.parametrize("name", sorted(_every_scheduler()))
@pytest.mark.parametrize("config", [BOTH, MOMENTUM, BASE], ids=["filter_momentum", "momentum",
                                                                 "neither"])
def test_every_scheduler_runs_three_steps(name: str, config: ShampooConfig) -> None:
    """Each scheduler of torch runs with ours; the cyclers (cycle_momentum=True, their
    default) need a moment to cycle: with neither filter nor momentum torch's own
    error comes at their construction, which is true of that config."""
    cycles = name in ("CyclicLR", "OneCycleLR")
    if cycles and config is BASE:
        with pytest.raises(ValueError, match="optimizer must support momentum or beta1"):
            _train(config, _every_scheduler()[name], 3)
        return
    start = [p.detach().clone() for p in _model().parameters()]
    got, seen = _train(config, _every_scheduler()[name], 3)
    assert all(math.isfinite(s["lr"]) for s in seen)
    assert not all(torch.equal(a, b) for a, b in zip(got, start, strict=True))
    if cycles:  # betas preferred when the defaults have them, as torch's Adam
        key = "betas" if "betas" in seen[0] else "momentum"
        assert len({str(s[key]) for s in seen}) == 3


# ------------------------------------------------------------ the group keys
def test_a_group_carries_the_keys_its_own_config_keeps() -> None:
    """Keys from the group's config, not the constructor's (torch's add_param_group
    would copy the defaults into every group); the defaults from the constructor's."""
    a, b, c = (nn.Parameter(torch.randn(3, 3)) for _ in range(3))
    other = dataclasses.replace(FILTER, gradient_filter=GradientFilterConfig(beta1=0.8))
    opt = Shampoo([{"params": [a]}, {"params": [b], "config": MOMENTUM},
                   {"params": [c], "config": other}], FILTER)
    assert opt.defaults["betas"] == (0.9, 0.99) and "momentum" not in opt.defaults
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    assert opt.param_groups[1]["momentum"] == 0.9 and "betas" not in opt.param_groups[1]
    assert opt.param_groups[2]["betas"] == (0.8, 0.99)
    assert "betas" not in Shampoo([a], BASE).param_groups[0]
    d = nn.Parameter(torch.randn(2))
    opt.add_param_group({"params": [d], "config": BASE.to_dict()})
    assert not {"betas", "momentum"} & set(opt.param_groups[3])
    e = nn.Parameter(torch.randn(2))
    opt.add_param_group({"params": [e], "betas": (0.5, 0.99)})  # the group's own value
    assert opt.param_groups[4]["betas"] == (0.5, 0.99)


def _stepped_once(config: ShampooConfig) -> tuple[Shampoo, nn.Parameter]:
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    opt = Shampoo([p], config)
    p.grad = torch.randn(4, 3, dtype=torch.float64)
    opt.step()
    return opt, p


@pytest.mark.parametrize(("key", "value", "match"), [
    ("betas", (0.9, 0.5), r"param_groups\[0\]\['betas'\]\[1\] = 0.5 is invalid: allowed 0.99"),
    ("betas", (1.0, 0.99), r"param_groups\[0\]\['betas'\]\[0\] = 1.0 is invalid: allowed a "
                           r"number in \[0, 1\)"),
    ("betas", (-0.1, 0.99), r"param_groups\[0\]\['betas'\]\[0\] = -0.1 is invalid"),
    ("betas", (True, 0.99), r"param_groups\[0\]\['betas'\]\[0\] = True is invalid"),
    ("betas", 0.9, r"param_groups\[0\]\['betas'\] = 0.9 is invalid: allowed a pair"),
    ("momentum", float("nan"), r"param_groups\[0\]\['momentum'\] = nan is invalid: allowed "
                               r"a number in \[0, 1\)"),
    ("momentum", torch.tensor(0.5), r"param_groups\[0\]\['momentum'\] = tensor\(0.5000\) is "
                                    "invalid"),
])
def test_a_bad_moment_is_refused_before_the_step_changes_anything(
        path: str, key: str, value: Any, match: str) -> None:
    opt, p = _stepped_once(BOTH)
    before = (p.detach().clone(), opt.state[p]["filtered"].clone(),
              opt.state[p]["momentum"].clone())
    opt.param_groups[0][key] = value
    p.grad = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert opt.state[p]["step"] == 1
    after = (p.detach(), opt.state[p]["filtered"], opt.state[p]["momentum"])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_key_the_config_keeps_no_moment_for_is_refused() -> None:
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['betas'\] = \(0.9, 1.0\) is "
                                         "invalid: this group's config keeps no gradient filter"):
        Shampoo([{"params": [nn.Parameter(torch.randn(2))], "betas": (0.9, 1.0)}], BASE)
    opt, p = _stepped_once(FILTER)
    opt.param_groups[0]["momentum"] = 0.9  # e.g. a scheduler told to cycle momentum
    p.grad = torch.randn(4, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\['momentum'\] = 0.9 is invalid: this group's "
                                         "config keeps no momentum"):
        opt.step()


# ---------------------------------------------------------------- checkpoints
def test_a_state_dict_keeps_the_groups_moments(tmp_path: Any) -> None:
    opt, p = _stepped_once(BOTH)
    opt.param_groups[0]["betas"] = (0.7, 0.99)
    opt.param_groups[0]["momentum"] = 0.4
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved = torch.load(tmp_path / "opt.pt", weights_only=True)
    fresh, q = _stepped_once(BOTH)
    fresh.load_state_dict(saved)
    assert tuple(fresh.param_groups[0]["betas"]) == (0.7, 0.99)
    assert fresh.param_groups[0]["momentum"] == 0.4
    for bad, match in [({"momentum": 1.5}, r"\['momentum'\] = 1.5 is invalid"),
                       ({"betas": (0.7, 0.9)}, r"\['betas'\]\[1\] = 0.9 is invalid")]:
        wrong = opt.state_dict()
        wrong["param_groups"][0].update(bad)
        with pytest.raises(ValueError, match="cannot load Shampoo state: param_groups\\[0\\]: "
                                             "param_groups\\[0\\]" + match):
            fresh.load_state_dict(wrong)
        assert fresh.param_groups[0]["momentum"] == 0.4
