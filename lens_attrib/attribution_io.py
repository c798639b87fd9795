"""Saving and loading Attributions: one ``.safetensors`` file, no pickle, no model needed.

Layout of a file (format version :data:`FORMAT_VERSION`):

* every tensor (``scores``, ``token_ids``, ``mask``, the target's positions and ids,
  ``layer_scores``, ``head_scores``, ``head_token_scores``, ``parts`` and tensors inside ``meta``)
  is a safetensors entry named by its path, e.g. ``scores``, ``meta/explained_value``,
  ``target/positions``; a collection prefixes the item's index or key: ``3/scores``;
* everything else (tokens, method, the target's ``regression`` flag, meta) is one JSON document in
  the safetensors header's metadata under the key ``"lens_attrib"``:
  ``{"format": "lens_attrib.attribution", "format_version": 1, "kind": ..., "content": ...}``.

JSON values are stored as themselves; values JSON cannot hold exactly are tagged objects with a
single ``$``-key: ``{"$tensor": name}``, ``{"$tuple": [...]}``, ``{"$float": "nan"|"inf"|"-inf"}``,
``{"$ndarray": name}`` (a numpy array, kept as numpy), ``{"$dict": [[key, value], ...]}`` (a dict
whose keys are not all plain strings), ``{"$dataclass": "ResolvedTarget", "fields": {...}}``.
numpy scalars become plain JSON numbers/booleans (a float32 scalar is widened exactly). Anything
else (a function, a module, an arbitrary object) is refused with an error naming where it sits:
nothing is ever pickled, so loading a file cannot run code.

The round trip is exact: every tensor comes back bit-identical with its dtype and shape (on the
CPU), strings, ints, floats, bools, lists, tuples and dicts compare equal. ``Target(head=...)``'s
callable is never part of an Attribution file (it keeps the *resolved* target: positions,
token/class ids, foil ids, regression flag, and the class labels in ``meta["target_tokens"]``),
so a loaded Attribution is complete without the head or the model for reading its scores. The
file does record that there was a head (``"head": "detached"`` beside the target's fields): the
loaded target then holds a :class:`~lens_attrib.target.DetachedHead`, which refuses to be read
(a metric on the model's own output would score another quantity) until
``attr.with_head(head)`` gives it back. A Target without a head loads with ``head=None``, as do
files written before this field existed.

A collection (a sweep's outputs) is a list or a dict of Attributions (dict keys: strings) in one
file, read back as the same container type with the same order and keys.

This module does not import :mod:`lens_attrib.attribution` (which delegates here): the
Attribution class is passed in as ``cls``; users call ``Attribution.save`` / ``Attribution.load``
and ``lens_attrib.save_attributions`` / ``load_attributions``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

FORMAT = "lens_attrib.attribution"
FORMAT_VERSION = 1
HEADER_KEY = "lens_attrib"


class AttributionFileError(ValueError):
    """A value that cannot be stored, or a file that is not a readable Attribution file."""


# ------------------------------------------------------------------------------------- encoding
class _Encoder:
    """Turns Python values into JSON values, moving tensors into ``self.tensors``."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}

    def _name(self, path: str) -> str:
        name, n = path, 1
        while name in self.tensors:
            n += 1
            name = f"{path}#{n}"
        return name

    def tensor(self, value: Tensor, path: str) -> str:
        if value.is_complex() or value.dtype in (torch.uint16, torch.uint32, torch.uint64):
            raise AttributionFileError(
                f"{path}: a {value.dtype} tensor cannot be stored in safetensors; convert it "
                "(e.g. .real / .to(torch.int64)) before saving."
            )
        name = self._name(path)
        # clone: safetensors refuses tensors that share storage (views of one another)
        self.tensors[name] = value.detach().cpu().contiguous().clone()
        return name

    def encode(self, value: Any, path: str) -> Any:
        if value is None or isinstance(value, bool | str):
            return value
        if isinstance(value, int):
            return int(value)
        if isinstance(value, float):
            return value if math.isfinite(value) else {"$float": repr(value)}
        if isinstance(value, Tensor):
            return {"$tensor": self.tensor(value, path)}
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise AttributionFileError(
                    f"{path}: a numpy array of Python objects cannot be stored."
                )
            return {"$ndarray": self.tensor(torch.from_numpy(np.ascontiguousarray(value)), path)}
        if isinstance(value, np.bool_):
            return bool(value)
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return self.encode(float(value), path)
        if isinstance(value, list):
            return [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"$tuple": [self.encode(v, f"{path}/{i}") for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in value):
                return {k: self.encode(v, f"{path}/{k}") for k, v in value.items()}
            pairs = []
            for k, v in value.items():
                if not isinstance(k, str | int | float | bool | tuple) and k is not None:
                    raise AttributionFileError(
                        f"{path}: the dict key {k!r} ({type(k).__name__}) cannot be stored; use "
                        "strings, numbers or tuples as keys."
                    )
                pairs.append([self.encode(k, f"{path}/key"), self.encode(v, f"{path}/{k}")])
            return {"$dict": pairs}
        from lens_attrib.target import ResolvedTarget

        if isinstance(value, ResolvedTarget):
            fields = {
                f.name: self.encode(getattr(value, f.name), f"{path}/{f.name}")
                for f in dataclasses.fields(value)
                if f.name != "head"  # a module, not data: only that there was one is kept
            }
            tagged = {"$dataclass": "ResolvedTarget", "fields": fields}
            return tagged | ({"head": "detached"} if value.head is not None else {})
        raise AttributionFileError(
            f"{path}: a {type(value).__module__}.{type(value).__qualname__} cannot be saved "
            "(lens_attrib never pickles). Store tensors, numpy arrays, numbers, strings, lists, "
            "tuples or dicts of them: convert or drop this entry before saving."
        )


def _decode(value: Any, tensors: Mapping[str, Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) >= 1 and any(isinstance(k, str) and k.startswith("$") for k in value):
        if "$tensor" in value:
            return tensors[value["$tensor"]]
        if "$ndarray" in value:
            return tensors[value["$ndarray"]].numpy()
        if "$float" in value:
            return float(value["$float"])
        if "$tuple" in value:
            return tuple(_decode(v, tensors) for v in value["$tuple"])
        if "$dict" in value:
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value["$dict"]}
        if value.get("$dataclass") == "ResolvedTarget":
            from lens_attrib.target import DetachedHead, ResolvedTarget

            fields = {k: _decode(v, tensors) for k, v in value["fields"].items()}
            head = DetachedHead() if value.get("head") == "detached" else None
            return ResolvedTarget(**fields, head=head)
        raise AttributionFileError(f"Unknown tagged value {sorted(value)} in the file.")
    return {k: _decode(v, tensors) for k, v in value.items()}


def _encode_attribution(
    encoder: _Encoder, attribution: Any, prefix: str, cls: type
) -> dict[str, Any]:
    if not isinstance(attribution, cls):
        where = prefix.rstrip("/") or "the value"
        raise AttributionFileError(
            f"{where} is a {type(attribution).__name__}, not an Attribution; a collection is a "
            "list or a dict (string keys) of Attributions."
        )
    return {
        f.name: encoder.encode(getattr(attribution, f.name), f"{prefix}{f.name}")
        for f in dataclasses.fields(cls)
    }


def _decode_attribution(record: Mapping[str, Any], tensors: Mapping[str, Tensor], cls: type) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(record) - known)
    if unknown:
        raise AttributionFileError(
            f"The file holds Attribution fields {unknown} that this lens_attrib does not know: "
            "it was written by a newer version; upgrade lens_attrib to read it."
        )
    return cls(**{k: _decode(v, tensors) for k, v in record.items()})


# ------------------------------------------------------------------------------------ public API
def _library_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lens-attrib")
    except PackageNotFoundError:
        return None


def _write(path: str | Path, kind: str, content: Any, encoder: _Encoder) -> Path:
    from safetensors.torch import save_file

    header = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "library_version": _library_version(),
        "content": content,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        encoder.tensors, str(path), metadata={HEADER_KEY: json.dumps(header, allow_nan=False)}
    )
    return path


def _read(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No Attribution file at {str(path)!r}.")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a foreign file
        raise AttributionFileError(
            f"{str(path)!r} is not a safetensors file written by Attribution.save ({err})."
        ) from err
    if HEADER_KEY not in metadata:
        raise AttributionFileError(
            f"{str(path)!r} is a safetensors file without lens_attrib's header: it was not "
            "written by Attribution.save / save_attributions."
        )
    header = json.loads(metadata[HEADER_KEY])
    version = header.get("format_version")
    if header.get("format") != FORMAT or not isinstance(version, int):
        raise AttributionFileError(
            f"{str(path)!r} has an unknown header format {header.get('format')!r}."
        )
    if version > FORMAT_VERSION:
        raise AttributionFileError(
            f"{str(path)!r} uses Attribution file format version {version} (written by "
            f"lens_attrib {header.get('library_version')}); this lens_attrib reads versions up to "
            f"{FORMAT_VERSION}. Upgrade lens_attrib to load it."
        )
    return header, tensors


def save_attribution(attribution: Any, path: str | Path, cls: type) -> Path:
    """Write one Attribution (an instance of the dataclass ``cls``) to ``path`` (a
    ``.safetensors`` file; module docstring: layout)."""
    encoder = _Encoder()
    content = _encode_attribution(encoder, attribution, "", cls)
    return _write(path, "attribution", content, encoder)


def load_attribution(path: str | Path, cls: type) -> Any:
    """Read an Attribution (built as ``cls``) written by :func:`save_attribution` (no model
    needed, CPU tensors)."""
    header, tensors = _read(path)
    if header["kind"] != "attribution":
        raise AttributionFileError(
            f"{str(path)!r} holds a collection of Attributions ({header['kind']}): read it with "
            "lens_attrib.load_attributions."
        )
    return _decode_attribution(header["content"], tensors, cls)


def save_attributions(collection: Any, path: str | Path, cls: type) -> Path:
    """Write a list or a dict (string keys) of Attributions to one ``.safetensors`` file.

    Each item's tensors are named ``{index or key}/{field}``; :func:`load_attributions` returns
    the same container type with the same order and keys.
    """
    encoder = _Encoder()
    if isinstance(collection, Mapping):
        bad = [k for k in collection if not isinstance(k, str)]
        if bad:
            raise AttributionFileError(
                f"A dict of Attributions needs string keys, got {bad[:3]!r}: use str(key)."
            )
        content: Any = {
            "type": "dict",
            "items": [
                [k, _encode_attribution(encoder, a, f"{k}/", cls)] for k, a in collection.items()
            ],
        }
    elif isinstance(collection, list | tuple):
        content = {
            "type": "list",
            "items": [
                _encode_attribution(encoder, a, f"{i}/", cls) for i, a in enumerate(collection)
            ],
        }
    else:
        raise AttributionFileError(
            f"save_attributions takes a list or a dict of Attributions, got "
            f"{type(collection).__name__}; for one Attribution use Attribution.save(path)."
        )
    return _write(path, "collection", content, encoder)


def load_attributions(path: str | Path, cls: type) -> list[Any] | dict[str, Any]:
    """Read a collection written by :func:`save_attributions` (a list or a dict, as saved)."""
    header, tensors = _read(path)
    if header["kind"] != "collection":
        raise AttributionFileError(
            f"{str(path)!r} holds a single Attribution: read it with Attribution.load(path)."
        )
    content = header["content"]
    if content["type"] == "dict":
        return {k: _decode_attribution(rec, tensors, cls) for k, rec in content["items"]}
    return [_decode_attribution(rec, tensors, cls) for rec in content["items"]]


__all__ = [
    "FORMAT_VERSION",
    "AttributionFileError",
    "load_attribution",
    "load_attributions",
    "save_attribution",
    "save_attributions",
]
