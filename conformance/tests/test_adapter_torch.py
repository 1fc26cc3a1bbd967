"""The torch adapters (``shampoo_conformance.adapters.torch``, ``.torch_ddp``, ``.torch_fsdp2``).

Their numerics are checked against the reference by the suite and by
torch_impl/tests; here: the contract's input errors name the backend and are
raised before any work (for torch-ddp, before a worker process starts), and
``run`` is ``Shampoo`` stepped on the given gradients, in the given dtype.
"""

from __future__ import annotations

import numpy as np
import pytest

from shampoo_spec import GraftingConfig, ShampooConfig

torch = pytest.importorskip("torch")

from shampoo_conformance.adapters import gloo_pool, torch_ddp, torch_fsdp2  # noqa: E402
from shampoo_conformance.adapters import torch as torch_adapter  # noqa: E402

CONFIG = ShampooConfig(learning_rate=0.1, grafting=GraftingConfig(type="adagrad"))


def _problem(steps: int = 3) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in params.items()} for _ in range(steps)]
    return params, grads


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_run_is_shampoo_stepped_on_the_gradients(dtype: type) -> None:
    from shampoo_torch import Shampoo

    params, grads = _problem()
    out = torch_adapter.run(CONFIG, params, grads, dtype=dtype)
    assert len(out) == len(grads) and all(v.dtype == np.dtype(dtype) for v in out[-1].values())
    tdtype = torch.float64 if dtype is np.float64 else torch.float32
    factor_dtype = "float64" if dtype is np.float64 else "float32"
    tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=tdtype)) for k, v in params.items()}
    config = ShampooConfig.from_dict({**CONFIG.to_dict(), "factor_dtype": factor_dtype})
    opt = Shampoo(list(tensors.items()), config)
    for step, want in zip(grads, out, strict=True):
        for k, p in tensors.items():
            p.grad = torch.tensor(step[k], dtype=tdtype)
        opt.step()
        for k, p in tensors.items():
            np.testing.assert_array_equal(p.detach().numpy(), want[k])


@pytest.mark.parametrize("module", [torch_adapter, torch_ddp, torch_fsdp2],
                         ids=["torch", "torch-ddp", "torch-fsdp2"])
def test_input_errors_name_the_backend(module: object) -> None:
    params, grads = _problem(1)
    name = {torch_adapter: "torch", torch_ddp: "torch-ddp"}.get(module, "torch-fsdp2")
    pool = gloo_pool._POOL
    with pytest.raises(ValueError, match=rf"invalid for the {name} backend"):
        module.run(CONFIG, params, grads, dtype=np.float16)  # type: ignore[attr-defined]
    assert gloo_pool._POOL is pool  # rejected before any worker started


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fsdp2_equals_ddp_bit_for_bit(dtype: type) -> None:
    """torch-fsdp2 (lossless) on the pool's two ranks equals torch-ddp, which equals one
    process: whole parameters, 0-d (replicated) and with an empty piece on rank 1."""
    rng = np.random.default_rng(1)
    params = {"w": rng.standard_normal((3, 4)), "r": rng.standard_normal((1, 3)),
              "s": np.asarray(rng.standard_normal())}
    grads = [{k: rng.standard_normal(np.shape(v)) for k, v in params.items()} for _ in range(3)]
    fsdp = torch_fsdp2.run(CONFIG, params, grads, dtype=dtype)
    ddp = torch_ddp.run(CONFIG, params, grads, dtype=dtype)
    for a, b in zip(fsdp, ddp, strict=True):
        assert set(a) == set(b)
        for k in a:
            assert a[k].dtype == np.dtype(dtype)
            np.testing.assert_array_equal(a[k], b[k])
