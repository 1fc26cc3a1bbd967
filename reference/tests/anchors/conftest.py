"""Make the anchor emulators importable as plain modules from these tests."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
