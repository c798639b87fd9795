"""The forwards of one evaluation call, each made once and at its item's own length.

A perturbation metric needs the model's output on the clean input of every item and on many
perturbed copies of it. :class:`SharedForwards` makes these forwards for one Attribution:

- **own length.** The clean and Soft forwards run an item's real tokens only, no padding: rows
  are grouped by their length and each group runs in chunks of ``max_batch`` rows
  (:func:`forward_by_length`), so no row pays for a longer neighbour. The hard rows (AOPC,
  insertion/deletion) of a decoder change length with every deleted token and fall into many
  groups of a few rows; there neighbouring lengths share a forward with a little padding where
  :func:`~lens_attrib.length_buckets.plan_forwards` (a fixed cost per forward plus work per
  padded token) finds that cheaper. Unpadded and padded forwards compute the same numbers up to
  floating-point summation order (the backend's padding hides padding keys and, for
  left-padded decoders, shifts rotary positions back).
- **the clean forward once.** :meth:`SharedForwards.clean_outputs` runs every item's clean
  input once (with every layer's attention pattern when ``patterns=True``: fixed routing
  replays them) and every metric family of a :func:`~lens_attrib.evaluation.metrics.score`
  call reads it — AOPC and insertion/deletion references, the Soft reference distribution,
  their clean rows.
- **identical hard perturbations once.** :meth:`SharedForwards.hard_values` keeps, per distinct
  ``(item, token ids, target index, segment ids)``, the values the hard metrics read, so AOPC
  fractions that delete the same tokens on a short item, the deletion curve's steps equal to
  AOPC's, and the empty deletion / full insertion (the clean input) are forwarded once per call.

What a hard row keeps (``[4]`` float64): for a classification head ``p(y_target)``,
``p(y_pred)`` (the explained token and the clean prediction), ``argmax p``, ``max p`` with
``p = softmax(head output)`` in float64; for a regression head its output, its output, 0, its
output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from lens_attrib.attribution import Attribution
from lens_attrib.backend import arch_of
from lens_attrib.forward import head_outputs
from lens_attrib.hooks.routing import pattern_cache_hooks
from lens_attrib.inputs import pad_id_of
from lens_attrib.length_buckets import plan_forwards
from lens_attrib.target import Head, check_head_attached

HardKey = tuple[int, tuple[int, ...], int, tuple[int, ...] | None]
GroupHooks = Callable[[Sequence[int], slice], list[Any]]
GroupReduce = Callable[[Tensor, Sequence[int]], Tensor]


@dataclass(frozen=True)
class OwnItem:
    """An item in unpadded coordinates: its real token ids, target index and segment ids."""

    ids: list[int]
    target: int
    types: list[int] | None


def own_items(attribution: Attribution) -> list[OwnItem]:
    """Every item of ``attribution`` without its padding."""
    out = []
    for b in range(len(attribution)):
        real = attribution.mask[b].cpu()
        first = int(torch.nonzero(real).min())
        ids = attribution.token_ids[b].cpu()[real].tolist()
        types = None
        if attribution.token_types is not None:
            types = attribution.token_types[b].cpu()[real].tolist()
        out.append(OwnItem(ids, int(attribution.target.positions[b]) - first, types))
    return out


def forward_by_length(
    model: Any,
    rows: Sequence[tuple[list[int], int, list[int] | None]],
    *,
    head: Head | None,
    max_batch: int,
    hooks: GroupHooks | None = None,
    reduce: GroupReduce | None = None,
    pad: bool = False,
) -> list[Tensor]:
    """Head outputs (or ``reduce(out, row_indices)``) of ``rows`` = ``(ids, target, types)``,
    one tensor per row, in ``rows`` order. Rows are grouped by length and run unpadded in
    chunks of ``max_batch``; with ``pad`` (and no ``hooks``), neighbouring lengths share a
    forward, padded on the model's side, where :func:`~lens_attrib.length_buckets.plan_forwards`
    finds that cheaper. ``hooks(row_indices, chunk)``: the forward hooks of a chunk of a group
    (its rows' indices into ``rows`` and the chunk's slice of the group)."""
    if pad and hooks is None:
        return _forward_planned(model, rows, head=head, max_batch=max_batch, reduce=reduce)
    groups: dict[int, list[int]] = {}
    for r, (ids, _, _) in enumerate(rows):
        groups.setdefault(len(ids), []).append(r)
    out: list[Tensor | None] = [None] * len(rows)
    for _, members in sorted(groups.items()):
        tokens = torch.tensor([rows[r][0] for r in members], dtype=torch.long)
        positions = torch.tensor([rows[r][1] for r in members], dtype=torch.long)
        types = None
        if any(rows[r][2] is not None for r in members):
            types = torch.tensor(
                [rows[r][2] or [0] * len(rows[r][0]) for r in members], dtype=torch.long
            )
        res = head_outputs(
            model,
            tokens,
            torch.ones_like(tokens, dtype=torch.bool),
            positions,
            head=head,
            hooks=_chunk_hooks(hooks, members),
            reduce=_chunk_reduce(reduce, members),
            max_batch=max_batch,
            token_types=types,
        )
        for j, r in enumerate(members):
            out[r] = res[j]
    return [o for o in out if o is not None]


def _forward_planned(
    model: Any,
    rows: Sequence[tuple[list[int], int, list[int] | None]],
    *,
    head: Head | None,
    max_batch: int,
    reduce: GroupReduce | None,
) -> list[Tensor]:
    """:func:`forward_by_length` with ``pad``: one padded forward per planned bucket chunk
    (left padding for decoders, right for encoders, through the backend's padding mask)."""
    left = not arch_of(model).encoder
    pad_id = pad_id_of(getattr(model, "tokenizer", None))
    out: list[Tensor | None] = [None] * len(rows)
    plan = plan_forwards([len(r[0]) for r in rows], lambda length: max_batch)
    for members in plan:
        length = max(len(rows[r][0]) for r in members)
        tokens = torch.full((len(members), length), pad_id, dtype=torch.long)
        mask = torch.zeros(len(members), length, dtype=torch.bool)
        has_types = any(rows[r][2] is not None for r in members)
        types = torch.zeros_like(tokens) if has_types else None
        positions = torch.zeros(len(members), dtype=torch.long)
        for j, r in enumerate(members):
            ids, target, seg = rows[r]
            off = length - len(ids) if left else 0
            tokens[j, off : off + len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[j, off : off + len(ids)] = True
            positions[j] = off + target
            if types is not None and seg is not None:
                types[j, off : off + len(ids)] = torch.tensor(seg, dtype=torch.long)
        res = head_outputs(
            model,
            tokens,
            mask,
            positions,
            head=head,
            reduce=_chunk_reduce(reduce, members),
            max_batch=len(members),
            token_types=types,
        )
        for j, r in enumerate(members):
            out[r] = res[j]
    return [o for o in out if o is not None]


def _chunk_hooks(hooks: GroupHooks | None, members: list[int]) -> Any:
    if hooks is None:
        return None

    def chunk_hooks(sl: slice) -> list[Any]:
        return hooks(members[sl], sl)

    return chunk_hooks


def _chunk_reduce(reduce: GroupReduce | None, members: list[int]) -> Any:
    if reduce is None:
        return None

    def chunk_reduce(out: Tensor, sl: slice) -> Tensor:
        return reduce(out, members[sl])

    return chunk_reduce


ItemKey = tuple[tuple[int, ...], int, tuple[int, ...] | None]
"""An item by content: its real token ids, target index and segment ids."""


@dataclass
class ForwardMemo:
    """Perturbed forwards kept across evaluation calls on the same items.

    A table evaluates many methods on one batch of items, one :func:`score` call each. Their
    perturbations often coincide: a π-Soft row's per-token keep mask is ``u < q`` with the
    uniforms ``u`` of the item and row (the same for every method) and the method's keep
    probabilities ``q``, so two methods that rank a short item's tokens alike draw the same
    mask (on 8 SST-2 sentences and 18 methods of the MiniLM table, 27 % of the distinct masks
    of one method recur in an earlier one); hard rows that delete the same tokens recur too.
    A memo keeps what every such row gave — a Soft row's distances to the clean output, keyed
    by routing, distance, item and mask; a hard row's summary, keyed by item, perturbed ids and
    explained token — so a later call forwards only rows no earlier call made. Rows keyed by
    their index rather than their mask (per-element Soft draws) are not kept.

    It serves calls on ``model`` with ``head`` (the same objects) and is valid while both stay
    as they are: make a new one after changing weights or hooks. Served numbers equal a fresh
    forward's up to floating-point summation order (another batch composition).
    """

    model: Any
    head: Head | None
    soft: dict[tuple[Any, ...], Tensor] = field(default_factory=dict)
    hard: dict[tuple[Any, ...], Tensor] = field(default_factory=dict)
    served: int = 0

    def serves(self, model: Any, head: Head | None) -> bool:
        """Whether the memo's rows are those of ``(model, head)``."""
        return self.model is model and self.head is head


@dataclass
class SharedForwards:
    """The clean and hard-perturbed forwards of one Attribution (module doc). ``head``: the
    head every metric reads (the attribution's own); ``patterns``: keep every layer's clean
    attention pattern (fixed routing); ``memo``: rows kept across calls (:class:`ForwardMemo`),
    consulted before forwarding and filled after."""

    model: Any
    attribution: Attribution
    head: Head | None
    max_batch: int
    patterns: bool = False
    memo: ForwardMemo | None = None
    items: list[OwnItem] = field(init=False)
    _clean: Tensor | None = field(default=None, init=False)
    _patterns: list[dict[str, Tensor]] | None = field(default=None, init=False)
    _hard: dict[HardKey, Tensor] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        check_head_attached(self.head)  # a loaded Attribution's head must be given back first
        self.items = own_items(self.attribution)
        if self.memo is not None and not self.memo.serves(self.model, self.head):
            raise ValueError(
                "this ForwardMemo holds the forwards of another model or head; make one "
                "ForwardMemo(model, head) per model and head (and a new one after changing "
                "either)."
            )

    def item_key(self, b: int) -> ItemKey:
        """Item ``b`` by content (what a :class:`ForwardMemo` keys its rows by)."""
        it = self.items[b]
        return (tuple(it.ids), it.target, None if it.types is None else tuple(it.types))

    def serves(self, model: Any, attribution: Attribution, head: Head | None) -> bool:
        """Whether these forwards are those of ``(model, attribution, head)``."""
        return self.model is model and self.attribution is attribution and self.head is head

    # ------------------------------------------------------------------------- clean
    def clean_outputs(self) -> Float[Tensor, "batch n_out"]:
        """Every item's clean head output (float64), one unpadded forward per item."""
        if self._clean is None:
            self._run_clean()
        assert self._clean is not None
        return self._clean

    def clean_patterns(self) -> list[dict[str, Float[Tensor, "head q k"]]]:
        """Every item's clean attention pattern per layer (computed with the clean outputs)."""
        if self._patterns is None:
            self.patterns = True
            self._run_clean()
        assert self._patterns is not None
        return self._patterns

    def _run_clean(self) -> None:
        rows = [(it.ids, it.target, it.types) for it in self.items]
        store: dict[str, list[Tensor]] = {}
        saving = pattern_cache_hooks(store)(int(self.model.cfg.n_layers)) if self.patterns else []
        order: list[int] = []

        def hooks(members: Sequence[int], sl: slice) -> list[Any]:
            order.extend(members)
            return list(saving)

        outs = forward_by_length(
            self.model, rows, head=self.head, max_batch=self.max_batch, hooks=hooks
        )
        if not outs:
            self._clean = torch.zeros(0, 0, dtype=torch.float64)
            self._patterns = []
            return
        self._clean = torch.stack([o.to(torch.float64) for o in outs]).cpu()
        if self.patterns:
            per_item: list[dict[str, Tensor]] = [{} for _ in self.items]
            for name, chunks in store.items():
                for r, pattern in zip(order, (p for chunk in chunks for p in chunk)):
                    per_item[r][name] = pattern
            self._patterns = per_item
        for b, it in enumerate(self.items):
            self._hard.setdefault(self._key(b, it.ids, it.target, it.types), self._summary(b))

    # ------------------------------------------------------------------------- hard rows
    def _key(self, b: int, ids: Sequence[int], target: int, types: Sequence[int] | None) -> HardKey:
        return (b, tuple(ids), int(target), None if types is None else tuple(types))

    def _summaries(self, out: Tensor, items: Sequence[int]) -> Tensor:
        """``[rows, 4]`` of head outputs ``out`` of rows of ``items`` (module doc)."""
        out = out.to(torch.float64)
        if self.attribution.target.regression:
            v = out[:, 0]
            return torch.stack([v, v, torch.zeros_like(v), v], -1).cpu()
        probs = torch.softmax(out, -1)
        idx = torch.arange(probs.shape[0], device=probs.device)
        target = self.attribution.target.token_ids.cpu().long()[list(items)].to(probs.device)
        pred = self.clean_outputs().argmax(-1)[list(items)].to(probs.device)
        top = probs.max(-1)
        cols = [probs[idx, target], probs[idx, pred], top.indices.to(torch.float64), top.values]
        return torch.stack(cols, -1).cpu()

    def _summary(self, b: int) -> Tensor:
        return self._summaries(self.clean_outputs()[b : b + 1], [b])[0]

    def hard_values(
        self, rows: Sequence[tuple[int, list[int], int, list[int] | None]]
    ) -> Float[Tensor, "rows 4"]:
        """The summaries of ``rows = (item, ids, target index, segment ids)``; each distinct
        row not seen before in this call is forwarded once (grouped by length, neighbouring
        lengths padded together where that is cheaper)."""
        self.clean_outputs()
        keys = [self._key(*row) for row in rows]
        missing = list(dict.fromkeys(k for k in keys if k not in self._hard))
        if self.memo is not None:
            missing = [k for k in missing if not self._from_memo(k)]
        if missing:
            items = [k[0] for k in missing]
            todo = [(list(k[1]), k[2], None if k[3] is None else list(k[3])) for k in missing]
            outs = forward_by_length(
                self.model,
                todo,
                head=self.head,
                max_batch=self.max_batch,
                reduce=lambda out, members: self._summaries(out, [items[m] for m in members]),
                pad=True,
            )
            for k, v in zip(missing, outs):
                self._hard[k] = v
                if self.memo is not None:
                    self.memo.hard[self._memo_key(k)] = v
        return torch.stack([self._hard[k] for k in keys])

    def _memo_key(self, key: HardKey) -> tuple[Any, ...]:
        """A hard row by content: the item, its perturbed ids, target index and segment ids,
        and the explained token (the summaries read it)."""
        b = key[0]
        token = int(self.attribution.target.token_ids[b])
        return (self.item_key(b), key[1], key[2], key[3], token)

    def _from_memo(self, key: HardKey) -> bool:
        """Take hard row ``key`` from the memo if it holds it."""
        assert self.memo is not None
        found = self.memo.hard.get(self._memo_key(key))
        if found is None:
            return False
        self._hard[key] = found
        self.memo.served += 1
        return True


def index_of_rows(keys: Sequence[bytes]) -> tuple[list[int], Int[Tensor, "rows"]]:
    """``(first row of each distinct key, index of each row's key among them)``."""
    first: dict[bytes, int] = {}
    firsts: list[int] = []
    where: list[int] = []
    for r, k in enumerate(keys):
        if k not in first:
            first[k] = len(firsts)
            firsts.append(r)
        where.append(first[k])
    return firsts, torch.tensor(where, dtype=torch.long)


__all__ = [
    "ForwardMemo",
    "OwnItem",
    "SharedForwards",
    "forward_by_length",
    "index_of_rows",
    "own_items",
]
