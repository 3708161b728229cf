"""The artifact catalogue: names glmctl knows, their repositories, roles and licences."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from glmctl.errors import ConfigError, UsageError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    repo_id: str | None
    role: Literal["base", "experts-exl3", "drafter", "other"]
    description: str = ""
    license: str | None = None
    include: tuple[str, ...] = ()


class _Catalog(BaseModel):
    model_config = ConfigDict(extra="forbid")

    artifacts: dict[str, dict]


@cache
def catalog() -> dict[str, Artifact]:
    text = resources.files("glmctl.hub").joinpath("catalog.yaml").read_text()
    try:
        raw = _Catalog.model_validate(yaml.safe_load(text))
        return {name: Artifact(name=name, **body) for name, body in raw.artifacts.items()}
    except ValidationError as exc:  # a packaging defect, not the operator's fault
        raise ConfigError(f"the shipped artifact catalogue is invalid: {exc}") from exc


def resolve(target: str, repo_override: str | None = None) -> Artifact:
    """An artifact by catalogue name, or an ad-hoc one for a Hub repo id."""
    known = catalog()
    if target in known:
        art = known[target]
        repo = repo_override or art.repo_id
        if repo is None:
            raise UsageError(
                f"artifact '{target}' has no repository recorded in glmctl's catalogue",
                hint=f"pass the repository that publishes it: glmctl fetch {target} --repo OWNER/NAME",
            )
        _check_repo_id(repo)
        return art.model_copy(update={"repo_id": repo})
    if repo_override:
        raise UsageError("--repo only applies to a catalogue artifact name", hint=f"glmctl fetch {repo_override}")
    _check_repo_id(target)
    return Artifact(name=target, repo_id=target, role="other")


def _check_repo_id(repo: str) -> None:
    if not REPO_ID.match(repo):
        names = ", ".join(sorted(catalog()))
        raise UsageError(
            f"'{repo}' is neither a catalogue artifact nor a Hugging Face repo id (OWNER/NAME)",
            hint=f"known artifacts: {names}",
        )
