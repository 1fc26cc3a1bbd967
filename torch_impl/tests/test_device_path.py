"""The accelerator path on any device (:mod:`shampoo_torch.device_path`).

``SHAMPOO_TORCH_PATH=accelerator`` takes the branches a CUDA device takes on
this CPU: the switch itself, eq. (3)'s deferred ``"raise"``
(:mod:`shampoo_torch.refusal`), and what a GPU pays for in a non-root step:
host syncs (``aten::_local_scalar_dense``), counted by the profiler.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from shampoo_spec import (
    BlockingConfig,
    FailureConfig,
    GraftingConfig,
    ScheduleConfig,
    ShampooConfig,
    from_meta,
)
from shampoo_torch import NonFiniteGradientError, Shampoo, describe, path_for

#: Meta's arguments as the issue's measurement takes them (roots every 10 from step 10).
META_KWARGS = {
    "lr": 1e-3, "betas": [0.9, 0.999], "epsilon": 1e-12, "max_preconditioner_dim": 16,
    "precondition_frequency": 10, "start_preconditioning_step": 10,
    "grafting_config": {"type": "AdaGradPreconditionerConfig", "epsilon": 1e-8},
}


@pytest.fixture
def accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHAMPOO_TORCH_PATH", "accelerator")


def test_the_switch_chooses_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHAMPOO_TORCH_PATH", raising=False)
    assert path_for("cpu") == "cpu" and path_for("meta") == "accelerator"
    assert describe("cpu") == "cpu (a cpu device)"
    monkeypatch.setenv("SHAMPOO_TORCH_PATH", "auto")
    assert path_for(torch.device("cpu")) == "cpu"
    monkeypatch.setenv("SHAMPOO_TORCH_PATH", "accelerator")
    assert path_for("cpu") == "accelerator"
    assert "forced by SHAMPOO_TORCH_PATH=accelerator" in describe("cpu")
    monkeypatch.setenv("SHAMPOO_TORCH_PATH", "gpu")
    with pytest.raises(ValueError, match="SHAMPOO_TORCH_PATH = 'gpu' is invalid"):
        path_for("cpu")


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _step(model: torch.nn.Module, opt: Shampoo, x: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


@pytest.mark.usefixtures("accelerator")
def test_a_non_root_step_reads_nothing_on_the_host() -> None:
    """Meta's arguments (eq. 3 ``"raise"``, AdaGrad graft, eq. 22's guard): step 12."""
    model, x = _model(), torch.randn(8, 12)
    opt = Shampoo(model.parameters(), from_meta(META_KWARGS))
    for _ in range(11):
        _step(model, opt, x)
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    syncs = [e.name for e in prof.events() if e.name == "aten::_local_scalar_dense"]
    assert syncs == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _config(root_every: int = 100) -> ShampooConfig:
    return ShampooConfig(
        learning_rate=0.1, grafting=GraftingConfig(type="adagrad"),
        blocking=BlockingConfig(max_preconditioner_dim=4),
        schedule=ScheduleConfig(precondition_frequency=root_every, start_preconditioning_step=1),
        failure=FailureConfig(nonfinite_gradient="raise"),
    )


def _pair(config: ShampooConfig) -> tuple[list[torch.nn.Parameter], Shampoo]:
    gen = torch.Generator().manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(6, 8, generator=gen)),
              torch.nn.Parameter(torch.randn(5, generator=gen))]
    return params, Shampoo([("w", params[0]), ("b", params[1])], config)


def _grads(step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(6, 8, generator=gen), torch.randn(5, generator=gen)]


@pytest.mark.usefixtures("accelerator")
def test_raise_is_deferred_to_the_next_host_read_and_skips_the_block() -> None:
    """The refused block is skipped at its step exactly as ``"skip_block"`` skips it;
    the error comes at the next read of the metrics, naming parameter, step and block,
    and once."""
    params, opt = _pair(_config())
    skip_params, skipping = _pair(dataclasses.replace(
        _config(), failure=FailureConfig(nonfinite_gradient="skip_block")))
    for t in range(4):
        grads = _grads(t)
        if t == 2:
            grads[0][5, 7] = float("nan")  # "w" at step 3 (step 1, a root step, read it all)
        for ps, o in ((params, opt), (skip_params, skipping)):
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            o.step()  # no error at the step: nothing is read on the host
    for p, q in zip(params, skip_params, strict=True):
        assert torch.equal(p, q)  # skipped as skip_block skips (4 steps, bit for bit)
    with pytest.raises(NonFiniteGradientError,
                       match=r"non-finite gradient in parameter 'w' at a step from 2 to 4 "
                             r"\(block \d+\).*accelerator path"):
        _ = opt.metrics
    assert opt.metrics["skipped_blocks"] == 0  # raised once; "raise" counts no skips
    assert skipping.metrics["skipped_blocks"] == 1


@pytest.mark.usefixtures("accelerator")
def test_a_pending_refusal_raises_at_the_next_root_step_before_it_changes_anything() -> None:
    params, opt = _pair(_config(root_every=3))
    for t in range(2):
        grads = _grads(t)
        if t == 1:
            grads[1][0] = float("inf")  # "b" at step 2
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    before = [p.detach().clone() for p in params]
    for p, g in zip(params, _grads(2), strict=True):
        p.grad = g
    with pytest.raises(NonFiniteGradientError, match=r"parameter 'b' at a step from 2 to 3"):
        opt.step()  # step 3 is a root step: it reads the host, and raises first
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    opt.step()  # the error was raised once; the step goes on
    assert not torch.equal(params[0], before[0])


@pytest.mark.usefixtures("accelerator")
def test_state_dict_raises_a_pending_refusal() -> None:
    params, opt = _pair(_config())
    for t in range(2):  # step 1 is a root step (it reads the host), step 2 is not
        grads = _grads(t)
        if t == 1:
            grads[0][0, 0] = float("inf")
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        opt.step()
    with pytest.raises(NonFiniteGradientError, match=r"parameter 'w' at step 2 \(block 0\)"):
        opt.state_dict()
    assert "state" in opt.state_dict()
