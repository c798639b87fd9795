"""Command-line building blocks shared by the runner, the experiments and the benchmarks.

Every flag has help text; method lists are validated against the registry *before* a model is
loaded (``--methods a,b`` with the registered names as choices), and ``--shard i/n`` is parsed
with an error that says what is expected.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _registered() -> list[str]:
    from lens_attrib.methods import METHODS

    return sorted(METHODS)


def method_list(text: str) -> list[str]:
    """``"a,b"`` -> ``["a", "b"]``, every name a registered method (argparse type)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    known = _registered()
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {unknown or [text]}; choose from {known} (comma-separated)"
        )
    return names


def variant_list(text: str) -> list[str]:
    """``"a,b[opt=v,…]"`` -> canonical variant labels (:mod:`lens_attrib.method_variants`), each
    a registered method whose options take the given values (argparse type)."""
    from lens_attrib.method_variants import split_method_list, split_variant, variant_label
    from lens_attrib.methods import METHODS
    from lens_attrib.methods.registry import OptionError

    try:
        parts = split_method_list(text)
        variants = [split_variant(p) for p in parts]
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    known = _registered()
    unknown = [name for name, _ in variants if name not in known]
    if not variants or unknown:
        raise argparse.ArgumentTypeError(
            f"unknown method(s) {unknown or [text]}; choose from {known} (comma-separated; "
            "options as name[option=value,...])"
        )
    for name, options in variants:
        try:
            METHODS[name].resolve_options(options)
        except OptionError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    labels = [variant_label(name, options) for name, options in variants]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"method(s) given twice: {repeated}")
    return labels


def choice_list(choices: list[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type for comma-separated values out of ``choices``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {unknown or [text]}; choose from {sorted(choices)}"
            )
        return names

    return parse


def shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n`` (argparse type)."""
    parts = text.split("/")
    try:
        i, n = (int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shard must look like i/n (e.g. 0/4: the first of four shards), got {text!r}"
        ) from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard i/n needs 0 <= i < n, got {text!r}")
    return i, n


def positive_int(text: str) -> int:
    """An integer ``>= 1`` (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def batch_or_auto(text: str) -> int | str:
    """A positive integer or ``auto`` (argparse type of ``--max-batch``)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer or 'auto', got {text!r}"
        ) from None


def add_methods_argument(
    parser: argparse.ArgumentParser, default: str, *, variants: bool = False
) -> None:
    """``--methods a,b,…`` validated against ``METHODS`` (the help lists the choices);
    ``variants=True``: also ``name[option=value,…]`` (:func:`variant_list`)."""
    kind = variant_list if variants else method_list
    extra = ""
    if variants:
        extra = " (options as name[option=value,...], e.g. grad_x_input[pooling=l1])"
    parser.add_argument(
        "--methods",
        type=kind,
        default=kind(default),
        metavar="M1,M2,…",
        help=f"comma-separated attribution methods, from: {', '.join(_registered())}{extra} "
        f"(default: {default})",
    )


def add_shard_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shard",
        type=shard,
        default=None,
        metavar="i/n",
        help="run only shard i of n (every n-th batch of the length-sorted plan; merge the "
        "outputs afterwards with merge_records, or launch with torchrun instead)",
    )


def start_token_choice(text: str) -> str | bool | None:
    """``--start-token``: ``default`` -> ``None`` (the model's policy), ``none`` -> ``False``,
    anything else -> that special token's text (checked against the tokenizer when used)."""
    value = text.strip()
    if not value:
        raise argparse.ArgumentTypeError(
            "--start-token needs a value: default, none, or a special token such as <|endoftext|>"
        )
    if value.lower() == "default":
        return None
    if value.lower() == "none":
        return False
    return value


def add_start_token_argument(parser: argparse.ArgumentParser) -> None:
    """``--start-token`` (see :func:`lens_attrib.inputs.start_token_of`)."""
    parser.add_argument(
        "--start-token",
        type=start_token_choice,
        default=None,
        metavar="TOKEN",
        help="start token before every text prompt: 'default' (the model's: the tokenizer's "
        "BOS where the config prepends one, else <|endoftext|>), 'none', or a special token",
    )


__all__ = [
    "add_methods_argument",
    "add_shard_argument",
    "add_start_token_argument",
    "batch_or_auto",
    "choice_list",
    "method_list",
    "positive_int",
    "shard",
    "start_token_choice",
    "variant_list",
]
