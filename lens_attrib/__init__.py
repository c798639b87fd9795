"""lens_attrib: token- and head-level attributions for TransformerLens models.

from lens_attrib import load_model, attribute, Target
model = load_model("smollm2-135m")
attr = attribute(model, "The keys to the cabinet", Target(" are", foil=" is"),
                 method="grad_x_input")
"""

from lens_attrib.attribution import Attribution, load_attributions, save_attributions
from lens_attrib.chat import ChatPrompt, chat_prompt
from lens_attrib.classifiers import Classifier, load_classifier
from lens_attrib.errors import (
    InputError,
    InputWarning,
    ModelError,
    NonFiniteError,
    OptionError,
    TargetError,
)
from lens_attrib.inputs import Batch, to_batch
from lens_attrib.methods import METHODS, MethodSpec, attribute
from lens_attrib.models import load_model
from lens_attrib.progress import show_progress
from lens_attrib.target import ResolvedTarget, Target
from lens_attrib.verify import VerifyReport, verify

__all__ = [
    "METHODS",
    "Attribution",
    "Batch",
    "ChatPrompt",
    "Classifier",
    "InputError",
    "InputWarning",
    "MethodSpec",
    "ModelError",
    "NonFiniteError",
    "OptionError",
    "ResolvedTarget",
    "Target",
    "TargetError",
    "VerifyReport",
    "attribute",
    "chat_prompt",
    "load_attributions",
    "load_classifier",
    "load_model",
    "save_attributions",
    "show_progress",
    "to_batch",
    "verify",
]
