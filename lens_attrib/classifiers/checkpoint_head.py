"""The class head a fine-tuned ``*ForSequenceClassification`` checkpoint came with.

:func:`class_head_of` converts a transformers BERT / RoBERTa sequence-classification head into a
:class:`ClassifierHead` on final residual rows (weights copied exactly), :func:`attach_class_head`
registers it on the TransformerLens model (:data:`lens_attrib.backend.CLASS_HEAD`), and
:func:`with_model_head` fills it into a :class:`~lens_attrib.target.Target` that names no head.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lens_attrib.backend import CLASS_HEAD, attached_head
from lens_attrib.target import Target


class ClassifierHead(nn.Sequential):
    """The head a fine-tuned ``*ForSequenceClassification`` encoder was trained with, on final
    residual rows: ``h(x) = W_out · tanh(W_d · x + b_d) + b_out`` (``[n, d_model] -> [n, n_out]``).

    BERT: ``W_d, b_d`` are the pooler's dense layer and ``W_out, b_out`` the classifier; RoBERTa:
    ``classifier.dense`` and ``classifier.out_proj`` (dropout is the identity at inference). The
    residual row is the one at ``[CLS]`` (real position 0). ``labels``: ``id2label`` in id order;
    ``regression``: one output explained directly (``problem_type="regression"``, or one label).
    An ``nn.Sequential`` (``dense``, ``activation``, ``out``) of a Linear layer, an ``nn.Tanh``
    module and a Linear layer, so that methods that decompose or apply rules module by module
    (DecompX's head, DeepLIFT's Rescale on the Tanh) see each part.
    """

    def __init__(
        self, d_model: int, n_out: int, labels: Sequence[str] | None, regression: bool
    ) -> None:
        super().__init__(
            OrderedDict(
                dense=nn.Linear(d_model, d_model),
                activation=nn.Tanh(),
                out=nn.Linear(d_model, n_out),
            )
        )
        self.labels = list(labels) if labels is not None else None
        self.regression = regression


def class_head_of(hf_model: Any, hf_config: Any) -> ClassifierHead:
    """The :class:`ClassifierHead` of a transformers ``*ForSequenceClassification`` model
    (BERT: ``bert.pooler.dense`` + ``classifier``; RoBERTa: ``classifier.dense`` +
    ``classifier.out_proj``), weights copied exactly, in the model's dtype."""
    classifier = hf_model.classifier
    if isinstance(classifier, nn.Linear):  # BERT: pooler + tanh, then the classifier
        base = getattr(hf_model, hf_model.base_model_prefix)
        if getattr(base, "pooler", None) is None:
            raise ValueError("A BERT classifier without its pooler cannot be converted.")
        dense, out = base.pooler.dense, classifier
    else:  # RoBERTa: classifier.dense + tanh + classifier.out_proj
        dense, out = classifier.dense, classifier.out_proj
    n_out = int(out.out_features)
    id2label = getattr(hf_config, "id2label", None) or {}
    labels = [str(id2label.get(i, id2label.get(str(i), f"LABEL_{i}"))) for i in range(n_out)]
    problem = getattr(hf_config, "problem_type", None)
    regression = problem == "regression" or (problem is None and n_out == 1)
    head = ClassifierHead(int(dense.in_features), n_out, labels, regression)
    head = head.to(dtype=out.weight.dtype)
    with torch.no_grad():
        head[0].load_state_dict(dense.state_dict())
        head[2].load_state_dict(out.state_dict())
    head.requires_grad_(False)
    return head.eval()


def attach_class_head(model: Any, head: nn.Module) -> None:
    """Make ``head`` the model's own head (a registered submodule: it follows ``.to()``, the model
    guard and dtype; :func:`lens_attrib.backend.attached_head` reads it)."""
    model.add_module(CLASS_HEAD, head)


def with_model_head(model: Any, target: Target) -> Target:
    """``target`` with the model's own class head filled in when it names no head: read at
    ``[CLS]`` (real position 0) unless a position is given, its labels and its regression flag."""
    head = attached_head(model)
    if head is None or target.head is not None:
        return target
    changes: dict[str, Any] = {"head": head}
    if target.position is None:
        changes["position"] = 0
    if getattr(head, "regression", False):
        changes["regression"] = True
    labels = getattr(head, "labels", None)
    if target.labels is None and labels:
        changes["labels"] = list(labels)
    return target.with_(**changes)


__all__ = ["ClassifierHead", "attach_class_head", "class_head_of", "with_model_head"]
