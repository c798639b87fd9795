"""Where results come from: the code version, the data's hash, the model's facts, journal paths.

A run's manifest (:mod:`lens_attrib.evaluation.journal`) and every journaled unit carry these,
so that a resumed run never mixes records of other data, another model or unknown code. The
runner and the experiments' journals (:mod:`experiments.resume`) both read them from here.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def code_version() -> dict[str, str | None]:
    """The package version and, when the code is a git checkout, its commit. A copy of a
    checkout (e.g. the tree sent to a GPU machine, whose ``.git``, if any, need not match the
    copied files) names the commit it was copied from in ``LENS_ATTRIB_GIT_COMMIT``, which
    then takes precedence."""
    try:
        version: str | None = importlib.metadata.version("lens-attrib")
    except importlib.metadata.PackageNotFoundError:
        version = None
    named = os.environ.get("LENS_ATTRIB_GIT_COMMIT")
    if named:
        return {"package": version, "git": named}
    root = Path(__file__).resolve().parents[2]
    commit = None
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        commit = head or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"package": version, "git": commit}


def data_hash(dataset: Sequence[Any]) -> str:
    """SHA-256 of every item's prompt, target, foil, task and evidence (the manifest's data id)."""
    digest = hashlib.sha256()
    for it in dataset:
        fields = {
            k: getattr(it, k, None)
            for k in ("prompt", "target", "foil", "task", "evidence_words", "evidence_positions")
        }
        digest.update(json.dumps(fields, default=repr, sort_keys=True).encode())
    return digest.hexdigest()


def model_facts(model: Any) -> dict[str, Any]:
    """The model's name, dtype and sizes, as a manifest records them."""
    return {
        "name": getattr(model.cfg, "model_name", None),
        "dtype": str(model.cfg.dtype),
        "n_layers": model.cfg.n_layers,
        "d_model": model.cfg.d_model,
        "d_vocab": model.cfg.d_vocab,
    }


def run_manifest(model: Any, dataset: Sequence[Any], config: dict[str, Any]) -> dict[str, Any]:
    """A run's manifest: its ``config`` with the model's facts, the data's hash and size, and
    the code version."""
    return {
        **config,
        "model": model_facts(model),
        "data_hash": data_hash(dataset),
        "dataset_size": len(dataset),
        "code_version": code_version(),
    }


def journal_path(out: str | Path, shard: tuple[int, int] | None) -> Path:
    """Where the records of ``out`` are journaled: ``<out stem>[.shard-i-of-n].records.jsonl``."""
    out = Path(out)
    tag = f".shard-{shard[0]}-of-{shard[1]}" if shard is not None else ""
    return out.with_name(f"{out.stem}{tag}.records.jsonl")


def shard_journal(journal: str | Path, shard: tuple[int, int] | None) -> Path:
    """A journal path given by the user, for ``shard``: ``records.jsonl.gz`` becomes
    ``records.shard-i-of-n.jsonl.gz`` (unchanged without a shard)."""
    journal = Path(journal)
    if shard is None:
        return journal
    name = journal.name
    ext = next((e for e in (".jsonl.gz", ".jsonl", ".gz") if name.endswith(e)), journal.suffix)
    return journal.with_name(f"{name.removesuffix(ext)}.shard-{shard[0]}-of-{shard[1]}{ext}")


__all__ = [
    "code_version",
    "data_hash",
    "journal_path",
    "model_facts",
    "run_manifest",
    "shard_journal",
]
