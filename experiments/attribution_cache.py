"""Attributions kept on disk for runs that explain the same batches again.

A π-Soft run and its insertion/deletion companion (``--metric-groups curves``), or a rerun of a
table with other metrics, explain every batch of items with the same methods and options. With
``--attribution-cache DIR`` each unit's :class:`~lens_attrib.attribution.Attribution` is saved
there (:meth:`Attribution.save`: one ``.safetensors`` file, no pickle, an exact round trip), and
a later unit that would make the same call loads it instead of calling ``attribute``. Integrated
Gradients is where this counts: on SmolLM2 its adaptive panels cost ≈ 80 CPU-s per item, the
rest of an insertion/deletion unit ≈ 1–3.

An entry's name is the SHA-256 of everything that decides the call's result:

- the library's code: the path and bytes of every ``lens_attrib/**/*.py`` file, and the
  versions of ``torch`` and ``transformer_lens``;
- the model: the caller's identity of the weights that compute the explained output (the
  classifier's :meth:`~lens_attrib.classifiers.Classifier.digest`, or
  :func:`~lens_attrib.classifiers.builtin.tensors_digest` of the model), its parameters' dtype
  and the device type;
- the call: the method, its options (JSON, sorted keys), the batch's inputs and the caller's
  identity of the target (a head's identity is the model's: a classifier's digest covers it).

A loaded Attribution gets the explained Target's head back (``Attribution.with_head``): the
file keeps only that there was one, and the metrics read it.

A changed line of the library, other weights, options, inputs or target never reuse an entry;
records computed from a loaded Attribution are those of the call itself, because the file holds
every tensor bit for bit. Entries are written to a temporary file and renamed into place, so
runs that share a folder never read half an entry; two runs that reach one unit together both
compute it, and the later rename replaces an equal file. An entry that cannot be read (damaged
on disk) is computed again, with a warning, and rewritten. The cache is for CPU runs (a loaded
Attribution's tensors are on the CPU): :class:`AttributionCache` refuses a model elsewhere.

A unit whose Attribution was loaded journals the CPU seconds of its evaluation and the load, so
``python -m experiments.run_costs`` prices such a method below its compute cost.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from lens_attrib.attribution import Attribution
from lens_attrib.attribution_io import AttributionFileError

LIBRARY_ROOT = Path(__file__).resolve().parent.parent / "lens_attrib"
"""The package whose source keys the entries."""

_CODE_KEYS: dict[Path, str] = {}


def code_key(root: Path = LIBRARY_ROOT) -> str:
    """SHA-256 (hex) of every ``*.py`` file under ``root`` (relative path and bytes, in path
    order) and the installed ``torch`` and ``transformer_lens`` versions; computed once per
    process and root."""
    if root not in _CODE_KEYS:
        sha = hashlib.sha256()
        for path in sorted(root.rglob("*.py")):
            sha.update(f"{path.relative_to(root).as_posix()}\0".encode())
            sha.update(path.read_bytes())
            sha.update(b"\0")
        for package in ("torch", "transformer_lens"):
            try:
                version = metadata.version(package)
            except metadata.PackageNotFoundError:
                version = "absent"
            sha.update(f"{package}=={version}\0".encode())
        _CODE_KEYS[root] = sha.hexdigest()
    return _CODE_KEYS[root]


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=repr)


class AttributionCache:
    """The entries of one folder for one model (module docstring).

    ``model_key``: the caller's identity of the weights that compute the explained output
    (e.g. the classifier's digest); ``model``: the explained model, for its dtype and device."""

    def __init__(self, folder: str | Path, model: Any, model_key: str):
        parameter = next(iter(model.parameters()), None)
        device = parameter.device if parameter is not None else torch.device("cpu")
        if device.type != "cpu":
            raise ValueError(
                f"--attribution-cache keeps Attributions for CPU runs, and the model is on "
                f"{device}: run without --attribution-cache there"
            )
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        dtype = parameter.dtype if parameter is not None else torch.get_default_dtype()
        self.prefix = _json([code_key(), model_key, str(dtype), device.type])
        self.hits = 0
        self.misses = 0
        self.unsaved: set[str] = set()

    def path(self, method: str, options: dict[str, Any], inputs: Sequence[Any], target: str):
        """The entry of ``attribute(model, inputs, target, method=method, **options)``."""
        text = _json([self.prefix, method, options, list(inputs), target])
        return self.folder / f"{hashlib.sha256(text.encode('utf-8')).hexdigest()}.safetensors"

    def get(
        self,
        method: str,
        options: dict[str, Any],
        inputs: Sequence[Any],
        target: str,
        compute: Callable[[], Attribution],
        head: Any = None,
    ) -> Attribution:
        """The entry's Attribution, else ``compute()``'s, saved as the entry. ``head``: the
        explained Target's head (``Target(head=...)``), given back to a loaded Attribution
        (a file keeps only that there was one: ``Attribution.with_head``)."""
        path = self.path(method, options, inputs, target)
        if path.exists():
            try:
                loaded = Attribution.load(path)
            except Exception as error:  # damaged on disk: computed again and rewritten
                warnings.warn(
                    f"--attribution-cache: {path} could not be read ({error}); {method} is "
                    "computed again and the entry rewritten",
                    RuntimeWarning,
                    stacklevel=2,
                )
            else:
                self.hits += 1
                return loaded.with_head(head)
        self.misses += 1
        attr = compute()
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".partial")
        os.close(handle)
        try:
            attr.save(temporary)
            os.replace(temporary, path)
        except AttributionFileError as error:  # a value the file format cannot hold
            self.unsaved.add(method)
            warnings.warn(
                f"--attribution-cache: {method}'s Attribution was computed but not kept: {error}",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        return attr

    def describe(self) -> str:
        """One line: the folder, entries loaded and computed (and methods not kept)."""
        line = (
            f"attribution cache {self.folder}: {self.hits} Attributions loaded, "
            f"{self.misses} computed"
        )
        if self.unsaved:
            line += f" (not kept: {', '.join(sorted(self.unsaved))})"
        return line
