"""Where glmctl keeps the operator's state. Everything is under one root that tests redirect.

    $GLMCTL_HOME            (default: $XDG_CONFIG_HOME/glmctl, else ~/.config/glmctl)
      profiles/             user serving profiles (*.yaml), read before the shipped ones
      licenses/             licence acceptance records (one JSON per licence id)
    $GLMCTL_CACHE           (default: $XDG_CACHE_HOME/glmctl, else ~/.cache/glmctl)
      calibration/          cached measurements (collectives copy-engine vs SM choice, ...)
"""

from __future__ import annotations

import os
from pathlib import Path

from glmctl import switches


def home() -> Path:
    if env := switches.read("GLMCTL_HOME"):
        return env
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "glmctl"


def cache() -> Path:
    if env := switches.read("GLMCTL_CACHE"):
        return env
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "glmctl"


def user_profiles() -> Path:
    return home() / "profiles"


def licenses() -> Path:
    return home() / "licenses"


def calibration() -> Path:
    return cache() / "calibration"
