"""Loads ``testlib.py`` once, under a name no other adapter's tests use."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "taskpoint_lightning_testlib"

if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, Path(__file__).with_name("testlib.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
