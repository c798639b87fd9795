"""Classifiers on a model's final residual: built-in ones trained and cached, trainable linear
heads, light fine-tuning of the last blocks, and the head a fine-tuned checkpoint came with.

- :mod:`~lens_attrib.classifiers.builtin` — :func:`load_classifier` and the built-in
  classifiers (``smollm2-135m-sst2``, ``minilm-l6-sst2``, ``minilm-l6-stsb``), trained on first
  use and cached.
- :mod:`~lens_attrib.classifiers.linear` — :class:`LinearHead` ``h(x) = W · n(x) + c``, its
  features, its fit on cached features and its storage.
- :mod:`~lens_attrib.classifiers.finetune` — the last ``k`` blocks and the head trained together.
- :mod:`~lens_attrib.classifiers.frozen_prefix` — the frozen lower blocks run once per item,
  the trained top blocks on length-grouped chunks (what makes fine-tuning fast).
- :mod:`~lens_attrib.classifiers.checkpoint_head` — a ``*ForSequenceClassification``
  checkpoint's own head (:class:`ClassifierHead`).
"""

from lens_attrib.classifiers.builtin import (
    CLASSIFIERS,
    PAIR_ENCODING,
    Classifier,
    ClassifierInfo,
    ClassifierSpec,
    data_hash,
    load_classifier,
    sst2_train_items,
    stsb_inputs,
    stsb_split,
    task_data,
    train_or_load,
)
from lens_attrib.classifiers.checkpoint_head import (
    ClassifierHead,
    attach_class_head,
    class_head_of,
    with_model_head,
)
from lens_attrib.classifiers.finetune import fine_tune, save_blocks, tuned_model
from lens_attrib.classifiers.linear import (
    LinearHead,
    evaluate_head,
    feature_position,
    fit_head,
    load_head,
    new_head,
    residual_features,
    save_head,
)

__all__ = [
    "CLASSIFIERS",
    "PAIR_ENCODING",
    "Classifier",
    "ClassifierHead",
    "ClassifierInfo",
    "ClassifierSpec",
    "LinearHead",
    "attach_class_head",
    "class_head_of",
    "data_hash",
    "evaluate_head",
    "feature_position",
    "fine_tune",
    "fit_head",
    "load_classifier",
    "load_head",
    "new_head",
    "residual_features",
    "save_blocks",
    "save_head",
    "sst2_train_items",
    "stsb_inputs",
    "stsb_split",
    "task_data",
    "train_or_load",
    "tuned_model",
    "with_model_head",
]
