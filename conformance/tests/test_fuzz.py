"""The fuzzer (shampoo_conformance.fuzz) on every backend: one test per invariant.

Invariants (docs/reliability.md): (a) construction succeeds or raises a
named ValueError; (b) a step succeeds with finite weights and state or raises
a project error and changes nothing; (c) a refused block is skipped as if
omitted; (d) checkpoint, resume: bit-identical; (e) a corrupted checkpoint
is refused and changes nothing; (f) torch DDP, fully_shard lossless and local
and HSDP equal one process, resumed across world sizes too; JAX sharded over
meshes decides as one device does, within its float32 bound. The Hypothesis
profile comes from ``HYPOTHESIS_PROFILE``
(``ci``: small and derandomized; ``fuzz``: the ``nox -s fuzz`` session).
Example counts scale with the profile's ``max_examples``; the cases run are
printed at the end of the session (and written as JSON to
``$SHAMPOO_FUZZ_COUNTS`` when set).

JAX compiles once per config and shapes, so its step invariants fuzz data
through the fixed configs of ``fuzz.configs.fixed_configs``; its config and
argument validation is fuzzed without compiling (``jax.eval_shape``).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shampoo_spec as ss
from shampoo_conformance.fuzz import COUNTS, corruption
from shampoo_conformance.fuzz import configs as fc
from shampoo_conformance.fuzz import data as fd
from shampoo_conformance.fuzz import invariants as inv
from shampoo_conformance.fuzz.drivers import BACKENDS, available
from shampoo_conformance.fuzz.values import HOSTILE, hostile_values

#: The profile's example budget; every test scales its own from it.
N = settings.default.max_examples
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def examples(weight: float) -> settings:
    return settings(max_examples=max(1, int(N * weight)), suppress_health_check=SLOW,
                    deadline=None)


@pytest.fixture(scope="session", params=BACKENDS)
def fuzz_backend(request: Any) -> str:
    why = available(request.param)
    if why is not None:
        pytest.skip(why)
    return str(request.param)


@pytest.fixture(scope="session", autouse=True)
def _case_counts(request: Any) -> None:
    """Print the cases run per invariant and backend after pytest's summary."""
    request.config.add_cleanup(_print_counts)


def _print_counts() -> None:
    if not COUNTS:
        return
    per: dict[tuple[str, str], int] = {}
    for (invariant, backend, _), n in COUNTS.items():
        per[(invariant, backend)] = per.get((invariant, backend), 0) + n
    lines = ["fuzz cases (invariant, backend: cases; outcomes):"]
    for (invariant, backend), n in sorted(per.items()):
        outcomes = ", ".join(f"{o} {c}" for (i, b, o), c in sorted(COUNTS.items())
                             if (i, b) == (invariant, backend))
        lines.append(f"  {invariant:22s} {backend:9s} {n:7d}  ({outcomes})")
    totals: dict[str, int] = {}
    for (_, backend), n in per.items():
        totals[backend] = totals.get(backend, 0) + n
    lines.append("  total per backend: " + ", ".join(f"{b} {n}" for b, n in sorted(totals.items())))
    print("\n".join(lines))
    path = os.environ.get("SHAMPOO_FUZZ_COUNTS")
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"cases": [[*k, n] for k, n in sorted(COUNTS.items())],
                       "per_backend": totals}, f, indent=1)


def _steps(backend: str) -> st.SearchStrategy[int]:
    return st.integers(1, 6)


@st.composite
def problems(draw: Any, backend: str, policy: str | None = None,
             coupling_free: bool = False) -> tuple[ss.ShampooConfig, dict[str, Any], Any]:
    """(config, initial weights, gradient stream) for ``backend``."""
    if backend == "jax":
        config = draw(fc.fixed_cases(policy, coupling_free))
        shapes = fc.FIXED_SHAPES
    else:
        config = draw(fc.step_configs(policy, coupling_free))
        shapes = draw(fd.named_shapes())
    params = fd.initial_params(shapes, draw(st.integers(0, 2**16)))
    stream, _ = draw(fd.gradient_streams(shapes, draw(_steps(backend))))
    return config, params, stream


# ------------------------------------------------------------------ (a)
@examples(4)
@given(fc.config_recipes())
def test_a_config_construction(recipe: fc.Recipe) -> None:
    """Every field of every section, hostile: a config or a ValueError naming a field."""
    inv.check_config_recipe(recipe)


@examples(2)
@given(st.sampled_from(["meta", "google"]), st.data())
def test_a_importers(which: str, data: st.DataObject) -> None:
    """Meta's and Google's arguments, hostile: a config, a named ValueError or
    NotImplementedError."""
    kwargs = data.draw(fc.meta_kwargs() if which == "meta" else fc.google_kwargs())
    inv.check_importer(which, kwargs)


HOSTILE_DTYPES = ("float64", "float32", "float16", "int64", "complex64", "bool")


@examples(1)
@given(st.data())
def test_a_backend_construction(fuzz_backend: str, data: st.DataObject) -> None:
    """Optimizer construction and arguments (config, lr, params, gradients): ValueError only."""
    config: Any = data.draw(st.one_of(fc.step_configs(), fc.step_configs(),
                                      st.sampled_from([None, "eigh", {}, 0.1, [], ss.EighConfig()]),
                                      fc.step_configs().map(lambda c: c.to_dict())))
    shapes = data.draw(st.lists(fd.construction_shapes(), min_size=0, max_size=3))
    names = [data.draw(st.sampled_from([f"p{i}", "", "a.b", "ü"])) for i in range(len(shapes))]
    dtype = data.draw(st.sampled_from(HOSTILE_DTYPES))
    bad_grad = data.draw(st.sampled_from(["ok", "transposed", "nan", "sparse", "missing",
                                          "string"]))
    what = f"config={config!r}, shapes={shapes}, dtype={dtype}, grad={bad_grad}"
    rng = np.random.default_rng(0)
    arrays = {f"{n}_{i}": rng.standard_normal(s).astype(dtype) for i, (n, s) in
              enumerate(zip(names, shapes, strict=True))}

    def grads_for(params: dict[str, np.ndarray]) -> dict[str, Any]:
        out: dict[str, Any] = {k: np.ones_like(v) for k, v in params.items()}
        if out and bad_grad != "ok":
            k = next(iter(out))
            if bad_grad == "transposed":
                out[k] = np.ones(np.shape(params[k])[::-1] + ((2,) if np.ndim(params[k]) < 2
                                                             else ()))
            elif bad_grad == "nan":
                out[k] = np.full(np.shape(params[k]), np.nan)
            elif bad_grad == "missing":
                del out[k]
            elif bad_grad == "string":
                out[k] = "gradient"
        return out

    if fuzz_backend == "reference":
        from shampoo_reference import ReferenceShampoo

        def after_ref(opt: Any) -> None:
            opt.step(grads_for(arrays))

        inv.check_construction("reference", lambda: ReferenceShampoo(config, dict(arrays)),
                               after_ref, what)
    elif fuzz_backend == "torch":
        _torch_construction(data, config, arrays, bad_grad, what)
    else:
        _jax_construction(data, config, arrays, grads_for, what)


def _torch_construction(data: st.DataObject, config: Any, arrays: dict[str, np.ndarray],
                        bad_grad: str, what: str) -> None:
    import torch

    from shampoo_torch import Shampoo

    lr = data.draw(st.one_of(st.none(), st.sampled_from(HOSTILE)))
    distributed = data.draw(st.sampled_from([None, None, "gloo", 2, {}]))
    what += f", lr={lr!r}, distributed={distributed!r}"

    def tensor(v: np.ndarray) -> torch.Tensor:
        t = torch.tensor(v)
        return torch.nn.Parameter(t) if t.is_floating_point() or t.is_complex() else t

    tensors = {k: tensor(v) for k, v in arrays.items()}

    def build() -> Any:
        kwargs: dict[str, Any] = {}
        if lr is not None:
            kwargs["lr"] = lr
        if distributed is not None:
            kwargs["distributed"] = distributed
        return Shampoo(list(tensors.items()), config, **kwargs)

    def after(opt: Any) -> None:
        params = [t for t in tensors.values() if t.is_floating_point()]
        if not params:
            opt.step()
            return
        for t in params:
            g = torch.ones_like(t)
            if bad_grad == "nan":
                g = torch.full_like(t, float("nan"))
            elif bad_grad == "sparse" and t.ndim > 0:
                g = g.to_sparse()
            t.grad = g
        before = {k: t.detach().clone() for k, t in tensors.items()}
        try:
            opt.step()
        except inv.PROJECT_ERRORS as err:
            # RootFailureError comes after a completed step (eq. 13): the step did change.
            refused = not isinstance(err, ss.RootFailureError)
            for k, t in tensors.items():
                if refused and not torch.equal(before[k], t.detach()) and not (
                    torch.isnan(before[k]).any()
                ):
                    raise inv.Violation(f"torch: a refused step changed {k!r} ({what})") from None
            raise

    inv.check_construction("torch", build, after, what)


def _jax_construction(data: st.DataObject, config: Any, arrays: dict[str, np.ndarray],
                      grads_for: Any, what: str) -> None:
    import jax

    from shampoo_jax import shampoo

    lr = data.draw(st.one_of(st.none(), hostile_values()))
    sharding = data.draw(st.sampled_from([None, None, "mesh", 0, {}]))
    what += f", learning_rate={lr!r}, sharding={sharding!r}"

    def build() -> Any:
        kwargs: dict[str, Any] = {}
        if lr is not None:
            kwargs["learning_rate"] = lr
        if sharding is not None:
            kwargs["sharding"] = sharding
        return shampoo(config, **kwargs)

    def after(opt: Any) -> None:
        params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in arrays.items()}
        state = jax.eval_shape(opt.init, params)
        grads = {k: jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype)
                 for k, v in grads_for(arrays).items() if not isinstance(v, str)}
        jax.eval_shape(opt.update, grads, state, params)

    inv.check_construction("jax", build, after, what)


# ------------------------------------------------------------------ (b)
@examples(1.5)
@given(st.data())
def test_b_step_finite_or_refused(fuzz_backend: str, data: st.DataObject) -> None:
    """Each step: finite weights and state, or a project error and nothing changed."""
    config, params, stream = data.draw(problems(fuzz_backend))
    dtype = data.draw(st.sampled_from([np.float32, np.float64])) \
        if fuzz_backend == "torch" else None
    inv.check_stream(fuzz_backend, config, params, stream, dtype)


# ------------------------------------------------------------------ (c)
@examples(0.6)
@given(st.data())
def test_c_skip_equals_omit(fuzz_backend: str, data: st.DataObject) -> None:
    """A refused block keeps its weights and state; the rest equals a zero-gradient block."""
    config, params, stream = data.draw(problems(fuzz_backend, "skip_block",
                                                coupling_free=data.draw(st.booleans())))
    inv.check_skip_equals_omit(fuzz_backend, config, params, stream)


# ------------------------------------------------------------------ (d)
@examples(0.6)
@given(st.data())
def test_d_checkpoint_round_trip(fuzz_backend: str, data: st.DataObject) -> None:
    """Checkpoint after k steps, resume in a fresh optimizer: bit-identical."""
    if fuzz_backend == "reference":
        pytest.skip("the reference has no checkpoint API")
    config, params, stream = data.draw(problems(fuzz_backend))
    at = data.draw(st.integers(0, len(stream)))
    inv.check_checkpoint(fuzz_backend, config, params, stream, at)


# ------------------------------------------------------------------ (e)
@examples(1)
@given(st.data())
def test_e_corrupt_checkpoint_refused(fuzz_backend: str, data: st.DataObject) -> None:
    """Wrong shapes, missing keys, another config, NaN entries...: ValueError, nothing changed."""
    if fuzz_backend == "reference":
        pytest.skip("the reference has no checkpoint API")
    config, params, stream = data.draw(problems(fuzz_backend))
    other = data.draw(fc.fixed_cases() if fuzz_backend == "jax" else fc.step_configs())
    kind = data.draw(st.sampled_from(corruption.CORRUPTIONS))
    corruption.check_corrupt_checkpoint(fuzz_backend, config, other, params, stream[:2], kind,
                                        data.draw(st.integers(0, 2**16)))


# ------------------------------------------------------------------ (f)
#: Cases per mode in one spawn, and spawns per world: the fuzz profile gives
#: 25 x 10 x 2 worlds = 500 cases per mode; ci 2 x 1 x 2.
DISTRIBUTED_BATCH = max(2, N // 136)


@st.composite
def distributed_cases(draw: Any, world: int) -> list[Any]:
    """Configs, shapes (0-d to 4-d, uneven shards) and hostile streams; a DDP poison."""
    cases = []
    for _ in range(DISTRIBUTED_BATCH):
        config = draw(fc.step_configs(draw(st.sampled_from(["skip_block", "raise"]))))
        shapes = draw(fd.named_shapes(large=False))
        params = fd.initial_params(shapes, draw(st.integers(0, 2**16)))
        steps = draw(st.integers(2, 4))
        stream, _ = draw(fd.gradient_streams(shapes, steps, hostile=True))
        name = draw(st.sampled_from(sorted(shapes)))
        size = int(np.prod(shapes[name]))
        poison = None
        if size and draw(st.booleans()):  # a NaN on one DDP rank only
            poison = (draw(st.integers(0, steps - 1)), draw(st.integers(0, world - 1)), name,
                      draw(st.integers(0, size - 1)))
        cases.append((config, params, stream, draw(st.integers(1, steps - 1)), poison))
    return cases


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=max(1, N // 340), suppress_health_check=SLOW, deadline=None)
@given(st.data())
def test_f_distributed_modes_equal_one_process(world: int, data: st.DataObject) -> None:
    """DDP, fully_shard lossless and local, HSDP: each equals one process, resumes too."""
    if available("torch") is not None:
        pytest.skip(str(available("torch")))
    from shampoo_conformance.fuzz.distributed import MODES, check_modes

    check_modes(world, MODES, data.draw(distributed_cases(world)))


#: Cases per mode of the JAX meshes: fuzz profile 500; ci 1 (a drawn config and policy
#: compiles five programs, most of the test's time).
JAX_MESH_CASES = N * 5 // 34 if N >= 340 else 1


def test_f_jax_meshes_equal_one_device(tmp_path: Any) -> None:
    """Block state sharded over 1-D and 2 x 2 meshes of host devices: the decisions of one
    device, weights within its float32 bound, replicas alike, resumes across meshes."""
    if available("jax") is not None:
        pytest.skip(str(available("jax")))
    from shampoo_conformance.fuzz.jax_meshes import check_meshes

    check_meshes(JAX_MESH_CASES, str(tmp_path / "counts.json"))


def test_f_local_pieces_with_unlike_graft_state_resume() -> None:
    """"local", Adafactor graft, a (5, 4) parameter at 4 ranks: pieces of 2, 2, 1 and 0
    rows, so one piece keeps an unfactored second moment where the others keep row and
    column factors; the state dict keys each piece's own entries (a found defect)."""
    if available("torch") is not None:
        pytest.skip(str(available("torch")))
    from shampoo_conformance.fuzz.distributed import check_modes

    graft = ss.GraftingConfig(type="adafactor", epsilon_placement="inside_sqrt", factor_min_dim=1)
    config = ss.ShampooConfig(grafting=graft)
    params = fd.initial_params({"w": (5, 4)}, 0)
    rng = np.random.default_rng(1)
    stream = [{"w": rng.standard_normal((5, 4))} for _ in range(3)]
    check_modes(4, ("fsdp_local",), [(config, params, stream, 1, None)])


# ------------------------------------------------------- large blocks (11)
def test_large_block_warns_naming_the_parameter(fuzz_backend: str) -> None:
    """A block dim > LARGE_BLOCK_DIM warns at construction, naming the parameter."""
    n = ss.LARGE_BLOCK_DIM + 1
    config = ss.ShampooConfig(blocking=ss.BlockingConfig(max_preconditioner_dim=n,
                                                         merge_dims_up_to=None))
    name = "huge_embedding"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if fuzz_backend == "reference":
            from shampoo_reference import ReferenceShampoo

            ReferenceShampoo(config, {name: np.zeros(n, np.float32)})
        elif fuzz_backend == "torch":
            import torch

            from shampoo_torch import Shampoo

            Shampoo([(name, torch.nn.Parameter(torch.zeros(n)))], config)
        else:
            import jax

            from shampoo_jax import shampoo

            jax.eval_shape(shampoo(config).init, {name: jax.ShapeDtypeStruct((n,), np.float32)})
    messages = [str(w.message) for w in caught]
    assert any(name in m for m in messages), (
        f"{fuzz_backend}: no warning naming {name!r} for a block dim {n}: {messages}")
    inv.count("large_block_warning", fuzz_backend, "warned")
