"""The one error hierarchy of glmctl.

Every library module raises a subclass of `GlmctlError` carrying a sentence for the operator and,
where there is one, the fix (`hint`). `glmctl.app.main` maps them to exit codes exactly once:
`UsageError` (bad flags, profiles, configs, licences not accepted) exits 2, everything else 1.
"""

from __future__ import annotations


class GlmctlError(Exception):
    """A failure the operator can act on. Exit code 1 unless a subclass says otherwise."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} (hint: {self.hint})"


class UsageError(GlmctlError):
    """The request itself is wrong: an option, a profile, a config file. Exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A config, profile or checkpoint description that does not validate."""


class LicenseError(UsageError):
    """An artifact's licence has not been accepted, or forbids the requested use."""


class DependencyError(GlmctlError):
    """An optional dependency (vLLM, torch, exllamav3, CUDA) is missing for this command."""


def require_module(module: str, extra: str, purpose: str):
    """Import `module` or raise a DependencyError that names the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - the message is what matters
        raise DependencyError(
            f"{purpose} needs the Python package '{module}', which is not importable ({exc})",
            hint=f"install the extra: pip install 'glmctl[{extra}]'",
        ) from exc
