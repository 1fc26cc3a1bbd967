"""Hypothesis profiles for every member's tests, shared with the conformance plugin.

``ci``   - small and derandomized: the same examples on every run, no example
           database, so CI is reproducible and a read-only checkout works.
``deep`` - many more examples for the ``conformance(backend=...)`` nox sessions.

The profile named by ``HYPOTHESIS_PROFILE`` is loaded (default ``ci``); nox
sets it per session. The definitions live in shampoo_conformance's pytest
plugin, which installed packages use too.
"""

from __future__ import annotations

import os

from hypothesis import settings

from shampoo_conformance.suite.pytest_plugin import register_profiles

register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
