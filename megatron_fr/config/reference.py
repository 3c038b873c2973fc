"""The run config's documentation, read from the schema: every setting's dotted key, type,
default and the docstring under its field (pydantic keeps it as the field's description).

`megatron-fr config show RECIPE [KEY] [key=value ...]` prints a recipe's resolved values beside
their defaults and docs; `megatron-fr config reference` writes docs/config.md, which the test
suite checks is current (tests/unit/test_config_reference.py)."""

from __future__ import annotations

import textwrap
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from megatron_fr.config.run import RunConfig


@dataclass(frozen=True)
class Setting:
    key: str
    """Dotted, as an override names it (learner.flash_reinforce.delta)."""
    type: str
    default: str
    """The schema's default as YAML would write it; "required" when there is none."""
    doc: str


def settings(model: type[BaseModel] = RunConfig, prefix: str = "") -> Iterator[Setting]:
    """Every leaf setting of `model`, in the schema's order; a field holding a config model
    (alone or optional) is walked into, its own line carrying the section's doc."""
    for name, field in model.model_fields.items():
        key, doc = prefix + name, " ".join((field.description or "").split())
        nested = _model_of(field.annotation)
        if nested is not None:
            if doc:
                yield Setting(key, nested.__name__, "(section)", doc)
            yield from settings(nested, key + ".")
            continue
        default = field.get_default(call_default_factory=True)
        shown = "required" if default is PydanticUndefined else _yaml(default)
        yield Setting(key, _type_name(field.annotation), shown, doc)


def section_docs(model: type[BaseModel] = RunConfig) -> dict[str, str]:
    """Each top-level section's class docstring (its first paragraph), by key."""
    out = {}
    for name, field in model.model_fields.items():
        nested = _model_of(field.annotation)
        if nested is not None and nested.__doc__:
            out[name] = " ".join(nested.__doc__.split("\n\n")[0].split())
    return out


def render_reference() -> str:
    """docs/config.md: one table per top-level section."""
    lines = [
        "# Configuration reference",
        "",
        "Every setting of a recipe, generated from the schema (`megatron_fr/config/`) by",
        "`.venv/bin/megatron-fr config reference --out docs/config.md`; the test suite fails when",
        "this page and the schema disagree. A recipe is one YAML file; any key can be overridden",
        "on the command line as `key=value` (dotted). `megatron-fr config show RECIPE [KEY]`",
        "prints a recipe's resolved values beside these defaults.",
    ]
    docs = section_docs()
    section = None
    for setting in settings():
        top = setting.key.split(".")[0] if "." in setting.key or setting.key in docs else "run"
        if top != section:
            section = top
            lines += ["", f"## {top}", ""]
            about = "The run as a whole." if top == "run" else docs.get(top)
            if about:
                lines += [about, ""]
            lines += ["| key | type | default | what it is |", "|---|---|---|---|"]
        if setting.default == "(section)" and setting.key == top:
            continue
        cells = [
            f"`{setting.key}`",
            _cell(setting.type),
            _cell(setting.default),
            _cell(setting.doc),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def show(config: RunConfig, key: str | None = None) -> str:
    """The resolved values of `config` (those under `key` if given), each with its default
    when it differs and its doc; ValueError naming a key that is not a setting."""
    values = _flatten(config.model_dump(mode="json"))
    chosen = [s for s in settings() if key is None or s.key == key or s.key.startswith(key + ".")]
    if not chosen:
        raise ValueError(f"{key!r} is not a setting (megatron-fr config show RECIPE lists them)")
    lines = []
    for setting in chosen:
        if setting.default == "(section)":
            lines.append(f"# {setting.key}: {setting.doc}")
            continue
        value = _yaml(values.get(setting.key))
        changed = "" if value == setting.default else f"   (default {setting.default})"
        lines.append(f"{setting.key} = {value}{changed}")
        if setting.doc:
            lines += textwrap.wrap(setting.doc, 96, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The config model a field holds (X or X | None), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [_model_of(arg) for arg in typing.get_args(annotation)]
        found = [m for m in models if m is not None]
        others = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(found) == 1 and len(others) == 1:
            return found[0]
    return None


def _type_name(annotation: Any) -> str:
    text = str(annotation) if not isinstance(annotation, type) else annotation.__name__
    return text.replace("typing.", "").replace("NoneType", "None")


def _yaml(value: Any) -> str:
    """A value as a recipe would write it."""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return ".inf" if value > 0 else "-.inf"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """Dotted keys to every value of a dumped config; a dict value (a section) also keeps
    its whole self under its own key, for settings that are free-form mappings."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        out[prefix + name] = value
        if isinstance(value, dict):
            out |= _flatten(value, prefix + name + ".")
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|") or " "
