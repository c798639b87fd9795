"""Cost of each method relative to a plain forward pass (NormXLogit paper Tables 4–5;
decomposition paper Table 8 analogue).

For every input length (default 40, 120, 360 tokens — add 512 with ``--lengths`` — of real IMDb
text, batch of one) the time of one ``attribute(...)`` call is divided by the time of a plain
``model(tokens)`` forward measured in the same run at the same length (median of ``--repeats``).
Memory: the peak extra memory of a call at batch sizes 1 and 2 (``--mem-length`` tokens) gives a
per-instance slope ``c`` and an offset ``a``; the largest batch within ``--budget-gb`` is
``⌊(budget − a) / c⌋`` (capped at ``--max-batch-cap``), reported beside the forward pass's. On CUDA
the peak is ``torch.cuda.max_memory_allocated``; on CPU it is the peak resident set size sampled
every millisecond by a thread (glibc is told to return freed blocks to the system so that the RSS
follows live tensors) — an approximation, good to a few MB.

    python -m experiments.speed --model smollm2-135m --out results/speed
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from experiments.common import base_parser, format_table, parse_list, setup, write_outputs
from lens_attrib import Target, attribute
from lens_attrib.cli import add_methods_argument
from lens_attrib.hooks.guard import model_guard
from lens_attrib.inputs import start_token_of

DEFAULT_METHODS = (
    "alti_logit,attnlrp,lrp,gradient,grad_x_input,rollout,attention,normxlogit,"
    "logat,embed_norm,grad_ellm,deeplift,reagent"
)


def parse_args(argv: Sequence[str] | None = None) -> Any:
    parser = base_parser(__doc__.split("\n")[0], n=1, out="results/speed")
    add_methods_argument(parser, DEFAULT_METHODS)
    parser.add_argument(
        "--lengths", default="40,120,360", help="the papers also use 512: --lengths 40,120,360,512"
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed calls per cell (median)")
    parser.add_argument("--mem-length", type=int, default=120)
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--max-batch-cap", type=int, default=4096)
    parser.add_argument("--no-memory", action="store_true")
    return parser.parse_args(argv)


# ------------------------------------------------------------------------------- inputs
def token_inputs(model: Any, length: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """``[batch, length]`` token ids of real text (IMDb reviews, concatenated), each row
    starting with the model's start token (:func:`lens_attrib.inputs.start_token_of`, as a text
    prompt would; ``length`` counts it)."""
    from lens_attrib.data import load_imdb

    tok = model.tokenizer
    text = " ".join(it.prompt.replace("<br />", " ") for it in load_imdb(n=40, seed=seed))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    start = start_token_of(model).id
    first = [] if start is None else [start]
    body = length - len(first)
    rows = [first + ids[i * 7 : i * 7 + body] for i in range(batch)]
    if any(len(r) < length for r in rows):
        raise ValueError(f"not enough text for {batch} × {length} tokens")
    return torch.tensor(rows, dtype=torch.long, device=model.cfg.device)


def forward_fn(model: Any) -> Callable[[torch.Tensor], Any]:
    def run(tokens: torch.Tensor) -> Any:
        with model_guard(model), torch.no_grad():
            return model(tokens)

    return run


def method_fn(model: Any, method: str) -> Callable[[torch.Tensor], Any]:
    def run(tokens: torch.Tensor) -> Any:
        return attribute(model, tokens, Target(), method=method)

    return run


def _sync(model: Any) -> None:
    if str(model.cfg.device).startswith("cuda"):
        torch.cuda.synchronize()


def time_call(
    model: Any, fn: Callable[[torch.Tensor], Any], tokens: torch.Tensor, repeats: int
) -> float:
    """Median wall time of ``fn(tokens)`` over ``repeats`` calls."""
    times = []
    for _ in range(max(1, repeats)):
        _sync(model)
        started = time.perf_counter()
        fn(tokens)
        _sync(model)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


# ------------------------------------------------------------------------------- memory
def _release_freed_memory() -> None:
    """glibc: allocate large blocks with mmap and trim the heap so RSS follows live memory."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: fixed 64 KiB (disables the dynamic one)
        libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * _page_size()


def _page_size() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE")


def peak_memory(model: Any, fn: Callable[[torch.Tensor], Any], tokens: torch.Tensor) -> float:
    """Peak extra bytes while ``fn(tokens)`` runs (CUDA allocator, or sampled CPU RSS)."""
    gc.collect()
    if str(model.cfg.device).startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(tokens)
        torch.cuda.synchronize()
        return float(torch.cuda.max_memory_allocated() - base)
    _release_freed_memory()
    base = _rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn(tokens)
    finally:
        done.set()
        thread.join()
    peak[0] = max(peak[0], _rss_bytes())
    return float(peak[0] - base)


def largest_batch(mem1: float, mem2: float, budget: float, cap: int) -> int:
    """``⌊(budget − a) / c⌋`` for ``mem(b) = a + c·b`` through ``(1, mem1)``, ``(2, mem2)``."""
    slope = max(mem2 - mem1, mem1 / 8, 1.0)  # noise can make the slope ≤ 0: bound it below
    offset = mem1 - slope
    return int(max(0, min(cap, (budget - offset) // slope)))


# ------------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    args = parse_args(argv)
    model = setup(args)
    methods, lengths = parse_list(args.methods), [int(x) for x in parse_list(args.lengths)]
    fns = {"forward": forward_fn(model), **{m: method_fn(model, m) for m in methods}}
    warm = token_inputs(model, min(lengths), seed=args.seed)
    for fn in fns.values():  # warm-up: first-call costs (allocations, lazy imports)
        fn(warm)
    summary: list[dict[str, Any]] = []
    for length in lengths:
        tokens = token_inputs(model, length, seed=args.seed)
        base = time_call(model, fns["forward"], tokens, args.repeats)
        for name, fn in fns.items():
            seconds = base if name == "forward" else time_call(model, fn, tokens, args.repeats)
            summary.append(
                {
                    "kind": "time",
                    "method": name,
                    "length": length,
                    "seconds": seconds,
                    "ratio": seconds / base,
                }
            )
        print(f"length {length}: forward {base * 1000:.0f} ms", flush=True)
    memory: dict[str, dict[str, float]] = {}
    if not args.no_memory:
        one = token_inputs(model, args.mem_length, 1, args.seed)
        two = token_inputs(model, args.mem_length, 2, args.seed)
        budget = args.budget_gb * 2**30
        for name, fn in fns.items():
            m1, m2 = peak_memory(model, fn, one), peak_memory(model, fn, two)
            memory[name] = {
                "mem1_mb": m1 / 2**20,
                "mem2_mb": m2 / 2**20,
                "largest_batch": largest_batch(m1, m2, budget, args.max_batch_cap),
            }
        fwd = max(memory["forward"]["largest_batch"], 1)
        for name, row in memory.items():
            summary.append(
                {
                    "kind": "memory",
                    "method": name,
                    "length": args.mem_length,
                    **row,
                    "batch_ratio": row["largest_batch"] / fwd,
                }
            )
    table = render(summary, ["forward", *methods], lengths, memory, args)
    print(table)
    figs = figures(summary, ["forward", *methods], lengths)
    paths = write_outputs(
        args.out,
        "speed",
        config={
            **vars(args),
            "methods": methods,
            "lengths": lengths,
            "start_token": start_token_of(model).describe(),
        },
        summary=summary,
        figures=figs,
        table=table,
        extra={"device": str(model.cfg.device), "threads": torch.get_num_threads()},
        argv=argv,
        started=started,
    )
    return {"summary": summary, "paths": paths, "table": table}


def render(
    summary: Sequence[dict[str, Any]],
    names: Sequence[str],
    lengths: Sequence[int],
    memory: dict[str, dict[str, float]],
    args: Any,
) -> str:
    times = {(r["method"], r["length"]): r for r in summary if r["kind"] == "time"}
    header = ["method", *[f"×fwd @{n}" for n in lengths], *[f"s @{n}" for n in lengths]]
    rows = [
        [
            m,
            *[times[(m, n)]["ratio"] for n in lengths],
            *[times[(m, n)]["seconds"] for n in lengths],
        ]
        for m in names
    ]
    lines = [
        f"Time per instance (batch 1) as a multiple of a plain forward, {args.model} on "
        f"{args.device} ({torch.get_num_threads()} threads), median of {args.repeats}",
        format_table(rows, header, fmt=lambda v: f"{v:.2f}"),
    ]
    if memory:
        fwd = max(memory["forward"]["largest_batch"], 1)
        rows = [
            [
                m,
                memory[m]["mem1_mb"],
                memory[m]["mem2_mb"],
                memory[m]["largest_batch"],
                memory[m]["largest_batch"] / fwd,
            ]
            for m in names
        ]
        lines += [
            "",
            f"Peak extra memory at {args.mem_length} tokens and the largest batch "
            f"within {args.budget_gb:g} GB (cap {args.max_batch_cap})",
            format_table(
                rows,
                ["method", "MB @b=1", "MB @b=2", "max batch", "÷ forward's"],
                fmt=lambda v: f"{v:.0f}" if isinstance(v, int) else f"{v:.2f}",
            ),
        ]
    return "\n".join(lines)


def figures(
    summary: Sequence[dict[str, Any]], names: Sequence[str], lengths: Sequence[int]
) -> list[Any]:
    import plotly.graph_objects as go

    fig = go.Figure()
    for m in names:
        per = {r["length"]: r["ratio"] for r in summary if r["kind"] == "time" and r["method"] == m}
        fig.add_trace(
            go.Scatter(x=list(lengths), y=[per[n] for n in lengths], mode="lines+markers", name=m)
        )
    fig.update_layout(
        title="Time per instance ÷ plain forward",
        xaxis_title="input tokens",
        yaxis_title="× forward",
        yaxis_type="log",
        height=450,
    )
    return [fig]


if __name__ == "__main__":
    main()
