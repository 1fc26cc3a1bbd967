"""Hypothesis profiles shared by every member's tests.

``ci``   - small and derandomized: the same examples on every run, no example
           database, so CI is reproducible and a read-only checkout works.
``deep`` - many more examples for the ``conformance_deep`` nox session.

The profile named by the environment variable ``HYPOTHESIS_PROFILE`` is
loaded (default ``ci``); nox sets it per session.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile(
    "ci", max_examples=25, derandomize=True, deadline=None, print_blob=True, database=None
)
settings.register_profile("deep", max_examples=500, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
