"""Finding and loading serving profiles: shipped ones (package data) and the user's own.

A profile is named by its file: `NAME.yaml`, in the user's directory (`glmctl.paths.user_profiles()`)
or shipped in `glmctl.profiles`; a user profile shadows a shipped one of the same name. A profile
may start from another with `extends: NAME`: mappings merge key by key (the child wins, `null`
removes a `vllm_args`/`env` entry), lists are replaced, and a mapping in the child that sets
`method` (i.e. `speculative`) replaces the parent's whole mapping, because its keys only make sense
together. A user profile that extends its own name starts from the shipped profile of that name.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import ValidationError

from glmctl import paths
from glmctl.errors import ConfigError
from glmctl.serving.schema import Profile, flag_key

Origin = Literal["user", "shipped", "file"]


@dataclass(frozen=True)
class ProfileSource:
    name: str
    origin: Origin
    path: Path


@dataclass(frozen=True)
class ProfileSummary:
    name: str
    origin: Origin
    path: Path
    usage: str | None
    platform: str | None
    description: str
    error: str | None = None


def _shipped_dir() -> Path:
    return Path(str(resources.files("glmctl.profiles")))


def sources() -> list[ProfileSource]:
    """Every profile file, user ones first (they shadow shipped ones of the same name)."""
    found = []
    for origin, root in (("user", paths.user_profiles()), ("shipped", _shipped_dir())):
        if root.is_dir():
            for path in sorted(root.glob("*.yaml")):
                found.append(ProfileSource(path.stem, origin, path))  # type: ignore[arg-type]
    return found


def find(name: str, skip: Path | None = None) -> ProfileSource:
    for src in sources():
        if src.name == name and src.path != skip:
            return src
    known = sorted({s.name for s in sources()})
    raise ConfigError(
        f"no serving profile named '{name}'",
        hint=f"known profiles: {', '.join(known)} (glmctl profile ls); user profiles live in "
        f"{paths.user_profiles()}",
    )


def _read(src: ProfileSource) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(src.path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read profile '{src.name}' ({src.path}): {exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"profile '{src.name}' ({src.path}) is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"profile '{src.name}' ({src.path}) must be a mapping of settings")
    if "name" in data:
        raise ConfigError(
            f"profile '{src.name}' ({src.path}) sets `name`",
            hint="a profile's name is its file name; remove the `name:` line",
        )
    args = data.get("vllm_args")
    if isinstance(args, dict):  # spelled as flags before merging, so a child's key replaces its parent's
        normalised: dict[str, Any] = {}
        for key, value in args.items():
            if flag_key(str(key)) in normalised:
                raise ConfigError(f"profile '{src.name}' ({src.path}): vllm_args '{key}' is given twice")
            normalised[flag_key(str(key))] = value
        data["vllm_args"] = normalised
    return data


def _merge(parent: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    merged = dict(parent)
    for key, value in child.items():
        base = merged.get(key)
        if isinstance(value, dict) and isinstance(base, dict) and "method" not in value:
            merged[key] = _merge(base, value)
        else:
            merged[key] = value
    return merged


def _resolve(src: ProfileSource, chain: tuple[str, ...]) -> dict[str, Any]:
    data = _read(src)
    parent_name = data.get("extends")
    if parent_name is None:
        return data
    if not isinstance(parent_name, str):
        raise ConfigError(f"profile '{src.name}': `extends` must be a profile name")
    if parent_name in chain and parent_name != src.name:
        raise ConfigError(f"profile '{src.name}': `extends` loops: {' -> '.join([*chain, parent_name])}")
    # A profile extending its own name starts from the next file of that name (the shipped one).
    if parent_name == src.name:
        others = [s for s in sources() if s.name == src.name and s.path != src.path]
        if src.origin == "shipped" or not others:
            raise ConfigError(
                f"profile '{src.name}' ({src.path}) extends itself",
                hint=f"a user profile may extend the shipped profile of its own name, and there is no shipped "
                     f"'{src.name}': set `extends` to another profile (glmctl profile ls) or remove it")
        parent = others[0]
    else:
        parent = find(parent_name)
    merged = _merge(_resolve(parent, (*chain, parent_name)), data)
    merged["extends"] = parent_name
    return merged


def validation_message(where: str, exc: ValidationError) -> str:
    """One readable line per problem: `field.path: what is wrong`."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(profile)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "not a profile setting (vLLM options go under `vllm_args`)"
        lines.append(f"  {loc}: {msg}")
    return f"{where} is not a valid serving profile:\n" + "\n".join(lines)


def load(name_or_path: str | Path) -> Profile:
    """The profile a name (or a YAML file path) resolves to, `extends` applied and validated."""
    candidate = Path(name_or_path)
    if candidate.suffix in (".yaml", ".yml") or len(candidate.parts) > 1:
        if not candidate.is_file():
            raise ConfigError(f"profile file {candidate} does not exist")
        src = ProfileSource(candidate.stem, "file", candidate.resolve())
    else:
        src = find(str(name_or_path))
    raw = _resolve(src, (src.name,))
    try:
        return Profile.model_validate({**raw, "name": src.name})
    except ValidationError as exc:
        raise ConfigError(
            validation_message(f"profile '{src.name}' ({src.path})", exc),
            hint="glmctl profile show NAME prints a shipped profile to start from",
        ) from exc


def summaries() -> list[ProfileSummary]:
    """Every visible profile (shadowed shipped ones left out), invalid ones with their error."""
    seen: set[str] = set()
    out = []
    for src in sources():
        if src.name in seen:
            continue
        seen.add(src.name)
        try:
            prof = load(src.name)
            out.append(ProfileSummary(src.name, src.origin, src.path, prof.usage, prof.platform,
                                      prof.description))
        except ConfigError as exc:
            out.append(ProfileSummary(src.name, src.origin, src.path, None, None, "", exc.message))
    return out
