"""Tasks: seeded template generators with evidence by construction, real-data loaders (BLiMP
from any folder), and the user's own JSONL/CSV items (:mod:`lens_attrib.data.user`).

>>> from lens_attrib.data import generate_sva, evidence_token_positions
>>> item = generate_sva(1, seed=0, n_attractors=1)[0]
>>> item.prompt, item.target, item.foil, item.evidence_words  # doctest: +SKIP
('The keys near the cabinet', ' are', ' is', (1,))
"""

from collections.abc import Callable

from lens_attrib.data.blimp import blimp_dir, number_counterpart
from lens_attrib.data.blimp_evidence import BLIMP_EVIDENCE_RULES, blimp_evidence
from lens_attrib.data.items import (
    Dataset,
    TaskItem,
    as_prompts,
    evidence_spans,
    evidence_token_positions,
    item_evidence_positions,
    span_token_positions,
    start_token_length,
    word_spans,
    word_token_positions,
)
from lens_attrib.data.loaders import (
    BOOLQ_PROMPT,
    SQUAD_PROMPT,
    blimp_paradigms,
    load_blimp,
    load_boolq,
    load_imdb,
    load_linzen_sva,
    load_squad_v2,
    load_sst2,
    load_stsb,
)
from lens_attrib.data.paths import DATA_ENV_VAR, data_root
from lens_attrib.data.templates import generate_anaphora, generate_dna, generate_sva
from lens_attrib.data.user import load_items, parse_item

GENERATORS: dict[str, Callable[..., list[TaskItem]]] = {
    "sva": generate_sva,
    "anaphora": generate_anaphora,
    "dna": generate_dna,
}
"""Task name -> template generator."""

__all__ = [
    "BLIMP_EVIDENCE_RULES",
    "BOOLQ_PROMPT",
    "DATA_ENV_VAR",
    "GENERATORS",
    "SQUAD_PROMPT",
    "Dataset",
    "TaskItem",
    "as_prompts",
    "blimp_dir",
    "blimp_evidence",
    "blimp_paradigms",
    "data_root",
    "evidence_spans",
    "evidence_token_positions",
    "generate_anaphora",
    "generate_dna",
    "generate_sva",
    "item_evidence_positions",
    "load_blimp",
    "load_boolq",
    "load_imdb",
    "load_items",
    "load_linzen_sva",
    "load_squad_v2",
    "load_sst2",
    "load_stsb",
    "number_counterpart",
    "parse_item",
    "span_token_positions",
    "start_token_length",
    "word_spans",
    "word_token_positions",
]
