"""The ``cpu_path`` marker: a test of a choice the CPU path makes (``shampoo_torch.device_path``).

Under ``SHAMPOO_TORCH_PATH=accelerator`` (the CI run of the branches a CUDA
device takes) such a test is skipped; its accelerator-path counterpart is in
``test_device_path.py``.
"""

from __future__ import annotations

import pytest

from shampoo_torch.device_path import on_cpu_path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cpu_path: tests a choice of the CPU path (skipped on the accelerator path)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if on_cpu_path("cpu"):
        return
    skip = pytest.mark.skip(reason="a CPU-path choice; SHAMPOO_TORCH_PATH=accelerator is set")
    for item in items:
        if item.get_closest_marker("cpu_path") is not None:
            item.add_marker(skip)
