"""The side-by-side benchmark's bookkeeping (bench_anchors): amortized step time,
p99, and the optimizer-state byte count, each against a closed form."""

from __future__ import annotations

import pytest

from shampoo_conformance.bench import anchors as ba

torch = pytest.importorskip("torch")


def test_amortized_time_is_the_mean_over_a_whole_period() -> None:
    timing = ba.Timing()
    steps = list(range(ba.FREQUENCY, 3 * ba.FREQUENCY))  # two whole periods
    for t in steps:
        timing.add(t, 5.0 if t % ba.FREQUENCY == 0 else 1.0 + (t % 3) / 10)
    whole = [5.0 if t % ba.FREQUENCY == 0 else 1.0 + (t % 3) / 10 for t in steps]
    # Equal to the plain mean only when the other steps' mean is the same in
    # every period; here it is within one step's spread / FREQUENCY.
    assert timing.amortized() == pytest.approx(sum(whole) / len(whole), abs=2e-3)
    # Nearest rank: the 198th of 200 sorted times, the slowest non-root step
    # (the two root steps are the 199th and 200th).
    assert timing.p99() == 1.2
    timing.add(3 * ba.FREQUENCY + 1, 5.0)  # one more slow step: now the 199th of 201
    assert timing.p99() == 5.0


def test_amortized_time_without_a_root_step_is_the_plain_mean() -> None:
    timing = ba.Timing()
    for t, dt in zip(range(1, 5), (1.0, 2.0, 3.0, 4.0), strict=True):
        timing.add(t, dt)
    assert timing.amortized() == 2.5
    assert timing.p99() == 4.0


def test_state_bytes_counts_each_storage_once_and_no_parameter() -> None:
    model = torch.nn.Linear(8, 4)
    model(torch.ones(2, 8)).sum().backward()
    opt = torch.optim.Adam(model.parameters())
    opt.step()
    # Adam: exp_avg and exp_avg_sq per parameter (float32) plus a 0-d step each.
    moments = 2 * sum(p.numel() * 4 for p in model.parameters())
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert ba._state_bytes(opt, model) == moments + steps
    # A view of a held tensor and a view of a parameter add nothing.
    state = opt.state[model.weight]
    state["view"] = state["exp_avg"][0]
    state["param_view"] = model.weight.detach()[1]
    assert ba._state_bytes(opt, model) == moments + steps


def test_launch_count_takes_a_foreach_op_once_and_counts_host_reads() -> None:
    """The bench's launch counter (bench.launches) against two optimizers whose step
    is known: SGD with foreach is one multi-tensor add for all four tensors and reads
    nothing; a step that reads one ``.item()`` has one host sync."""
    from shampoo_conformance.bench import launches

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))

    x = torch.ones(2, 4)
    sgd = launches.count_step(model(), lambda p: torch.optim.SGD(p, lr=0.1, foreach=True),
                              x, warmup=1)
    assert sgd == (1, 0, 0)

    class Reading(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[no-untyped-def]
            out = super().step(closure)
            float(self.param_groups[0]["params"][0].detach().sum())  # one host read
            return out

    ops, syncs, _ = launches.count_step(model(), lambda p: Reading(p, lr=0.1, foreach=True),
                                        x, warmup=1)
    assert syncs == 1 and ops > 2  # the add, the sum, the read (and the detach)
