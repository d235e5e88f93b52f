"""A service's typed settings object as the environment variables its process reads.

localmesh decides each process's settings as that service's own settings class (so a name the
class lacks is refused here, not ignored by the service) and writes the process's environment
from the object, named and encoded as pydantic-settings parses it back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TypeGuard, TypeVar, cast

from pydantic import AliasChoices, AliasPath, BaseModel
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

Settings = TypeVar("Settings", bound=BaseSettings)


def unknown_names(model: type[BaseModel], values: Mapping[str, Any], within: str = "") -> list[str]:
    """The keys of values, and of the mappings given for nested models, that are not fields of
    model (dotted for nested ones)."""
    unknown = []
    for name, value in values.items():
        field = model.model_fields.get(name)
        if field is None:
            unknown.append(within + name)
        elif isinstance(value, Mapping) and _is_model(field.annotation):
            unknown += unknown_names(field.annotation, value, f"{within}{name}.")
    return unknown


def checked(model: type[BaseModel], values: dict[str, Any]) -> dict[str, Any]:
    """values, once every name in them is a field of model: settings classes with extra="ignore"
    (every tokenmesh one) drop a misspelt name without a word."""
    unknown = unknown_names(model, values)
    if unknown:
        raise ValueError(f"{model.__name__} has no setting {', '.join(unknown)}")
    return values


class _ValuesOnly(BaseSettings):
    """Reads only the values it is given, not the environment (nor .env or secrets files)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def build(cls: type[Settings], **values: Any) -> Settings:
    """cls validated from exactly these values (every name a field of cls), without reading
    this process's environment: what localmesh decides, whatever its own shell sets (the
    shell's variables still reach the service, in the environment supervisord passes down)."""
    values_only = type(cls.__name__, (_ValuesOnly, cls), {"__module__": cls.__module__})
    validated = values_only(**checked(cls, values))
    # cls itself again, from the validated fields, so that it equals what the service builds
    # from the environment (cast: pydantic's mypy plugin types this as the bound, BaseSettings).
    built = cls.model_construct(_fields_set=validated.model_fields_set, **dict(validated))
    return cast(Settings, built)


def environment(settings: BaseSettings) -> dict[str, str]:
    """The variables from which settings' class builds settings again: one for each field set on
    it (model_fields_set), with the class's env_prefix, aliases and env_nested_delimiter;
    strings as they are, everything else as JSON (numbers, booleans, lists, mappings)."""
    config = settings.model_config
    delimiter = config.get("env_nested_delimiter") or ""
    none_text = config.get("env_parse_none_str")
    case_sensitive = config.get("case_sensitive")
    variables: dict[str, str] = {}

    def add(model: BaseModel, prefix: str) -> None:
        values = model.model_dump(mode="json", exclude_unset=True)
        for name, field in type(model).model_fields.items():
            if name not in values:
                continue
            value = getattr(model, name)
            key = _alias(field) or prefix + name
            key = key if case_sensitive else key.upper()
            if delimiter and isinstance(value, BaseModel):
                add(value, key + delimiter)
            elif value is not None:
                text = values[name]
                variables[key] = text if isinstance(text, str) else json.dumps(text)
            elif none_text is not None:
                variables[key] = none_text
            elif field.default is not None:
                # No variable gives None back: its absence gives the default.
                raise ValueError(f"{key}: None has no environment form (default {field.default!r})")

    add(settings, config.get("env_prefix", ""))
    return variables


def _is_model(annotation: Any) -> TypeGuard[type[BaseModel]]:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _alias(field: FieldInfo) -> str | None:
    """The name pydantic-settings reads a field under instead of prefix + name, if any."""
    alias = field.validation_alias or field.alias
    if isinstance(alias, AliasChoices):
        alias = next((choice for choice in alias.choices if isinstance(choice, str)), None)
    if isinstance(alias, AliasPath):
        raise ValueError(f"an AliasPath ({alias.path}) has no one environment variable")
    return alias
