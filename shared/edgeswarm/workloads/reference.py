"""Every job kind's spec as a reference table, read off its pydantic model: each field (nested ones dotted), its type,
its default and what it means. docs/reference.md holds the tables this writes (a test holds the two equal), so the
documentation of a spec cannot drift from the spec a coordinator checks."""

from __future__ import annotations

import enum
import inspect
import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from edgeswarm.workloads import kinds, workload

MAX_DEPTH = 4  # nested specs are a few levels deep; deeper would be a cycle


def type_name(annotation: Any) -> str:
    """A field's type as a reader of a YAML spec sees it: ``int``, ``one of "a", "b"``, ``float or null``."""
    origin = get_origin(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(type_name(a) for a in get_args(annotation))
    if origin in (list, tuple, set, frozenset):
        args = [a for a in get_args(annotation) if a is not Ellipsis]
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if get_origin(annotation) is not None and hasattr(annotation, "__metadata__"):  # Annotated[...]
        return type_name(get_args(annotation)[0])
    if inspect.isclass(annotation) and issubclass(annotation, enum.Enum):
        return "one of " + ", ".join(f"`{m.value}`" for m in annotation)
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "mapping (below)"
    if inspect.isclass(annotation):
        return {"str": "text", "int": "integer", "float": "number", "bool": "true or false", "Path": "path",
                "Any": "any"}.get(annotation.__name__, annotation.__name__)
    return str(annotation).replace("typing.", "")


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default is PydanticUndefined and field.default_factory else field.default
    if isinstance(value, BaseModel):
        return "(below)"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value}`" if value not in ((), [], {}) else "empty"


def _nested(annotation: Any) -> type[BaseModel] | None:
    """The one spec model ``annotation`` holds (``X``, ``X | None``), or None."""
    candidates = [annotation, *get_args(annotation)] if get_origin(annotation) in (Union, types.UnionType) \
        else [annotation]
    models = [c for c in candidates if inspect.isclass(c) and issubclass(c, BaseModel)]
    return models[0] if len(models) == 1 else None


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _bounds(field: Any) -> str:
    """The field's numeric bounds (``>= 1, <= 4096``), empty when it has none."""
    found = [f"{sign} {getattr(m, attr)}" for m in field.metadata for attr, sign in _BOUNDS
             if getattr(m, attr, None) is not None]
    return ", ".join(found)


def _prose(text: str | None) -> str:
    return " ".join(inspect.cleandoc(text or "").split())


def field_rows(model: type[BaseModel], prefix: str = "", depth: int = 0) -> list[tuple[str, str, str, str]]:
    """``(field, type, default, meaning)`` of every field of ``model``, a nested spec's fields after it as
    ``parent.child`` (the nested spec's docstring is its field's meaning when the field has no description)."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        inner = _nested(field.annotation)
        meaning = _prose(field.description) or (_prose(inner.__doc__) if inner is not None else "")
        bounds = _bounds(field)
        rows.append((dotted, type_name(field.annotation) + (f" ({bounds})" if bounds else ""), _default(field),
                     meaning))
        if inner is not None and depth < MAX_DEPTH:
            rows.extend(field_rows(inner, f"{dotted}.", depth + 1))
    return rows


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def spec_reference(kind: str) -> str:
    """The reference of job kind ``kind``'s spec: a heading, its model's docstring and the table of its fields."""
    spec_type = workload(kind).spec_type
    doc = _prose(spec_type.__doc__)
    lines = [f"### `{kind}` ({spec_type.__name__})", "", doc, "", "| field | type | default | meaning |",
             "|---|---|---|---|"]
    lines += [f"| `{f}` | {_escape(t)} | {_escape(d)} | {_escape(m)} |" for f, t, d, m in field_rows(spec_type)]
    return "\n".join(lines) + "\n"


def all_spec_references() -> str:
    """Every installed kind's reference, in registry order (built-in kinds first)."""
    return "\n".join(spec_reference(kind) for kind in kinds())


BEGIN = "<!-- job specs: generated by edgeswarm.workloads.reference.with_spec_references; do not edit -->"
END = "<!-- end of job specs -->"


def with_spec_references(page: str) -> str:
    """``page`` (docs/reference.md's text) with what lies between ``BEGIN`` and ``END`` written anew from the specs.
    To regenerate: ``python -c 'from pathlib import Path; from edgeswarm.workloads.reference import
    with_spec_references as w; p = Path("docs/reference.md"); p.write_text(w(p.read_text()))'``. Raises ValueError
    when the page has no such markers."""
    if BEGIN not in page or END not in page:
        raise ValueError("the page has no job-spec markers")
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n\n{all_spec_references()}\n{END}{tail}"
