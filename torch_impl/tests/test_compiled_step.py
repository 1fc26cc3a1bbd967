"""``Shampoo(..., compile=...)``: every non-root step one ``torch.compile`` graph
(``fullgraph=True``: a graph break raises), no recompile once warm (the step count a
symbolic int, an LR scheduler's rate included), root steps eager; eager's bits with
a backend that runs eager's kernels, within the stated ulps under Inductor
(docs/spec.md, section 5, the compiled step)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from shampoo_conformance.suite.cases import Case, named_cases
from shampoo_spec import NonFiniteGradientError, ShampooConfig, from_meta
from shampoo_torch import DistributedConfig, Shampoo, device_path

#: Meta's arguments, roots every 5 steps from step 5, everything in float64.
KWARGS = {"lr": 1e-2, "betas": [0.9, 0.999], "epsilon": 1e-12, "max_preconditioner_dim": 8,
          "precondition_frequency": 5, "start_preconditioning_step": 5,
          "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-8}}


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The accelerator path, and Dynamo's caches empty before and after (they are per
    code object: every optimizer's ``_phases`` shares them)."""
    monkeypatch.setenv(device_path.ENV, "accelerator")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _config(**kwargs: Any) -> ShampooConfig:
    return dataclasses.replace(from_meta({**KWARGS, **kwargs}), factor_dtype="float64")


def _decaying(opt: Shampoo) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + 0.1 * t))


def _train(compile: Any, steps: int, after: Callable[[int], None] = lambda t: None,
           scheduler: Callable[[Shampoo], Any] = _decaying, **kwargs: Any
           ) -> list[torch.Tensor]:
    """A small MLP (two blocked weights, biases, a 1-element parameter) in float64 with a
    decaying learning rate (or ``scheduler``'s); the parameters after ``steps`` steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()
    opt = Shampoo(model.parameters(), _config(**kwargs), compile=compile)
    sched = scheduler(opt)
    x = torch.randn(32, 6, dtype=torch.float64)
    y = torch.randn(32, 1, dtype=torch.float64)
    for t in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        sched.step()
        after(t)
    return [p.detach().clone() for p in model.parameters()]


def test_non_root_steps_are_one_graph_compiled_once_warm_with_eagers_bits() -> None:
    compiles: list[int] = []
    runs: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        """Counts compilations and runs; runs the graph's own (eager) kernels."""
        compiles.append(1)

        def run(*args: Any) -> Any:
            runs.append(1)
            return gm.forward(*args)
        return run

    by_step: dict[int, tuple[int, int]] = {}
    got = _train(backend, 32, lambda t: by_step.update({t: (len(compiles), len(runs))}))
    want = _train(False, 32)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # Warm: the first root step (5) and the steps after it have run; from then on no
    # compile, through root steps 15, 20, 25, 30 and a learning rate changing each step.
    assert by_step[32][0] == by_step[12][0] <= 6
    # Every non-root step but the first ran the graph; the first step and the root
    # steps (5, 10, ..., 30) ran eagerly.
    eager = {1, 5, 10, 15, 20, 25, 30}
    assert by_step[32][1] - by_step[12][1] == sum(1 for t in range(13, 33) if t not in eager)


def _one_cycle(opt: Shampoo) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=40)


# With the filter, OneCycleLR cycles betas[0] (eq. 15); without it, momentum (eq. 20).
@pytest.mark.parametrize("kwargs", [{"betas": [0.9, 0.999], "use_bias_correction": True},
                                    {"betas": [0.0, 0.999], "momentum": 0.5}],
                         ids=["betas", "momentum"])
def test_a_scheduler_cycling_momentum_recompiles_nothing_once_warm(kwargs: dict[str, Any]
                                                                     ) -> None:
    """OneCycleLR (cycle_momentum) writes the group's lr and betas[0] or momentum at every
    step: each enters the graph as lr does, a symbolic float, so no recompile once warm,
    and the compiled steps keep eager's bits."""
    compiles: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Callable[..., Any]:
        compiles.append(1)
        return gm.forward

    by_step: dict[int, int] = {}
    got = _train(backend, 32, lambda t: by_step.update({t: len(compiles)}), _one_cycle,
                 **kwargs)
    want = _train(False, 32, scheduler=_one_cycle, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert by_step[32] == by_step[12] <= 6
    still = _train(False, 32, scheduler=lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.02, total_steps=40, cycle_momentum=False), **kwargs)
    assert not all(torch.equal(a, b) for a, b in zip(still, want, strict=True))


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("clang++") is None,
                    reason="Inductor's CPU kernels need a C++ compiler")
@pytest.mark.parametrize("betas", [[0.9, 0.999], [0.0, 1.0]])  # with and without a filter
def test_inductor_is_within_the_stated_ulps_of_eager(betas: list[float]) -> None:
    """Inductor sums in its own order: float64 parameters within steps * n * kappa^(1/2)
    * u of eager relative to their displacement (docs/spec.md, section 5, the compiled
    step: 8 steps, n = 12, kappa^(1/2) <= 1e4)."""
    steps, bound = 8, 8 * 12 * 1e4 * 2.0**-53
    start = _train(False, 0)
    got = _train(True, steps, betas=betas)
    want = _train(False, steps, betas=betas)
    for g, w, s in zip(got, want, start, strict=True):
        moved = float((w - s).abs().max())
        assert moved > 0 and float((g - w).abs().max()) <= bound * moved


def test_compile_refuses_what_it_cannot_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    params = [nn.Parameter(torch.randn(3, 3))]
    with pytest.raises(ValueError, match=r"compile = 'no-such-backend' is invalid: allowed"):
        Shampoo(params, compile="no-such-backend")
    with pytest.raises(ValueError, match=r"compile = 1 is invalid"):
        Shampoo(params, compile=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"invalid with distributed: allowed in one process"):
        Shampoo(params, compile=True, distributed=DistributedConfig())
    monkeypatch.delenv(device_path.ENV)
    with pytest.raises(ValueError, match=r"takes the CPU path .* SHAMPOO_TORCH_PATH=accelerator"):
        Shampoo(params, compile=True)
    assert Shampoo(params, compile=False)._compiled is None


def _refused_at_step_7(compile: Any) -> str:
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    opt = Shampoo(model.parameters(), _config(), compile=compile)
    assert opt.param_groups[0]["config"].failure.nonfinite_gradient == "raise"
    for t in range(1, 8):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        if t == 7:
            model.weight.grad[0, 0] = float("nan")
        opt.step()
    assert all(opt.state[p]["step"] == 7 for p in model.parameters())
    with pytest.raises(NonFiniteGradientError, match="from 6 to 7") as raised:
        opt.check_refusals()  # pending since the root step 5
    return str(raised.value)


def test_a_refusal_in_a_compiled_step_is_raised_at_the_next_host_read() -> None:
    """Eq. (3) ``"raise"`` in a compiled step: the block is skipped on the device and the
    error comes at the next host read, naming the steps as the eager step does."""
    assert _refused_at_step_7("aot_eager") == _refused_at_step_7(False)


@pytest.mark.parametrize("case", named_cases()[::4], ids=lambda case: case.name)
def test_the_suites_configs_compile_whole_with_eagers_bits(case: Case) -> None:
    """Every fourth named case of the conformance suite (one per rule of docs/spec.md;
    all 53 pass when run over ``named_cases()``): its non-root
    steps trace as one graph (Dynamo alone: the backend runs the captured ops)
    and end where the eager steps end, bit for bit."""
    params, grads = case.problem()
    outs = []
    for compile in (False, "eager"):
        torch._dynamo.reset()
        ps = {k: nn.Parameter(torch.tensor(v)) for k, v in params.items()}
        opt = Shampoo(list(ps.items()), case.config, compile=compile)
        for g in grads:
            for k, p in ps.items():
                p.grad = torch.tensor(g[k])
            opt.step()
        outs.append([p.detach() for p in ps.values()])
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def _resumed(compile: Any) -> list[torch.Tensor]:
    """7 steps, a state_dict into a fresh model and optimizer, 5 steps more."""
    torch.manual_seed(0)
    x, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 1, dtype=torch.float64)

    def make() -> tuple[nn.Module, Shampoo]:
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 1)).double()
        return model, Shampoo(model.parameters(), _config(), compile=compile)

    def steps(model: nn.Module, opt: Shampoo, n: int) -> None:
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    model, opt = make()
    steps(model, opt, 7)
    saved, weights = opt.state_dict(), model.state_dict()
    torch._dynamo.reset()  # as a new process would start
    model, opt = make()
    model.load_state_dict(weights)
    opt.load_state_dict(saved)
    steps(model, opt, 5)
    return [p.detach() for p in model.parameters()]


def test_a_resumed_compiled_run_continues_the_eager_one_bit_for_bit() -> None:
    """A loaded state (and a new param group) is first stepped eagerly, so the kept
    vectors the graph reuses exist before it is traced."""
    got, want = _resumed("aot_eager"), _resumed(False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    torch.manual_seed(0)
    first, second = nn.Linear(3, 2).double(), nn.Linear(2, 2).double()
    opt = Shampoo(first.parameters(), _config(), compile="aot_eager")
    for t in range(6):
        if t == 3:
            opt.add_param_group({"params": list(second.parameters())})
        opt.zero_grad(set_to_none=True)
        second(first(torch.randn(4, 3, dtype=torch.float64))).sum().backward()
        opt.step()
    assert opt.state[second.weight]["step"] == 3
