"""The plan `kiln/startup.py` fills phase by phase and `kiln/startup_report.py` shows and
records. A module of its own so that the report reads the plan without importing the planner,
which itself calls the report (the effective config's hash): no import circle between the two
(tests/unit/test_layering.py)."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.settings.resolve import ResolvedSettings


@dataclass
class StartupPlan:
    args: argparse.Namespace
    hardware: Any = None  # kiln.resolve.hardware.HardwareInfo
    source: Any = None  # kiln.resolve.sources.ModelSource
    # The model's config (kiln.models.config.ModelConfig), read without opening weights; for
    # an external engine, of any architecture.
    model_config: Any = None
    # kiln.models.loader.Checkpoint (weight files listed, none loaded): only where kiln's own
    # engine runs the model, so only then does kiln's loader judge the architecture.
    checkpoint: Any = None
    settings: ResolvedSettings | None = None
    engines_cfg: dict[str, Any] = field(default_factory=dict)
    config_file: Path | None = None
    preset: str | None = None
    preset_reason: str = ""
    preset_code: str | None = None  # the branch that chose the preset (preset.<why>)
    phase: str = "start"
    extra: dict[str, Any] = field(default_factory=dict)  # engine facts after loading
    started: float = field(default_factory=time.monotonic)
