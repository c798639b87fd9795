"""Our SmolLM2-135M attributions against the Hugging Face path: LXT, plain autograd and Captum.

    python -m benchmarks.bench_peers --peer-python /path/to/python [--lengths 128 512]
        [--reps 10] [--ig-reps 3] [--ig-steps 50] [--ig-length 128] [--no-memory] [--no-time]
        [--profile-kinds grad_x_input attnlrp]

``--peer-python`` is a Python with ``transformers < 5``, ``lxt`` (2.x) and ``captum`` installed (and
``torch`` of the same version as ours); this file runs in it as a script (``--worker``) and imports
only their public APIs. The same GGUF weights (dequantised by transformers, cached once with
``save_pretrained`` under our cache folder) and the same token ids (ours, no BOS) are used on both
sides, float32, batch 1, one thread everywhere. Compared, by kind of call:

===============  ==========================================  =====================================
kind             ours (``lens_attrib``)                      peer
===============  ==========================================  =====================================
forward          ``model(tokens)`` (full logits)             ``hf(input_ids).logits``
forward_last     the engine's path: blocks, then ``ln_final``  ``hf(input_ids, logits_to_keep=1)``
                 + unembedding of the last row only
grad_x_input     ``attribute(.., method="grad_x_input")``    autograd on ``inputs_embeds``
attnlrp          ``attribute(.., method="attnlrp")``         LXT 2 ``monkey_patch(modeling_llama)``
                                                             + Gradient×Input (its README recipe)
ig               ``attribute(.., "integrated_gradients")``   Captum ``IntegratedGradients`` on
                                                             ``inputs_embeds``
===============  ==========================================  =====================================

Peer attributions freeze the parameters (no weight gradients) and unembed only the last row
(``logits_to_keep=1``), the fastest use of their API; the explained scalar is the top logit at the
last position on both sides. IG: ``--ig-steps`` steps; Captum gets the same baseline as ours (the
pad/eos embedding, the first token kept) and ``internal_batch_size`` equal to the number of steps
ours runs per forward, so both batch alike. Ours runs twice: ``ours`` (with
:func:`lens_attrib.fastpath.enable_fast_forward`) and ``ours_copy`` (with
:func:`~lens_attrib.fastpath.disable_fast_forward`: TransformerLens' per-forward weight copies, the
state before the fast path), so one run gives the before/after table.

Time: one long-lived worker process per side holds its model; the main process asks them in turn
for one call each (round-robin, order reversed every other round, one warm-up round first), so load
from other processes on a shared machine hits all sides alike; the table shows the minimum over
``--reps`` rounds (``--ig-reps`` for IG). Peak memory: every (side, kind) runs once more in a
fresh process; after loading and a warm-up call the worker resets the resident-set high-water mark
(``echo 5 > /proc/self/clear_refs``) and reports ``VmHWM − VmRSS`` around the measured call
(``peak_extra_mb``, the memory the call needs beyond the loaded model) and ``VmHWM``; it also
reports ``VmRSS`` right after loading, before any call (``loaded_mb``: the resident model).

Profile (``--profile-kinds``): one call of each listed kind per side, in a fresh process after a
warm-up call, under ``torch.profiler`` with FLOP counting; the table splits its self CPU time into
the matrix products (``mm``/``addmm``/``bmm``/``baddbmm``, with their GFLOP and GFLOP/s), the fused
attention kernels and everything else, and gives the GFLOP/s one thread reaches here on a bare
``F.linear`` of the MLP's shape: equal FLOPs at the core's rate on both sides is a floor no
rearrangement of the rest can go below.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TEXT = (
    "The keys to the old wooden cabinet in the hallway of my grandmother's house were lost "
    "last summer, and nobody in the family has been able to find them since then. "
)
SIDES = ("ours", "ours_copy", "hf", "lxt")
PEER_OF = {
    "forward": "hf",
    "forward_last": "hf",
    "grad_x_input": "hf",
    "attnlrp": "lxt",
    "ig": "hf",
}
GOALS = {  # ours ÷ peer, from the issue (not tests)
    "forward": 1.05,
    "forward_last": 1.05,
    "grad_x_input": 0.9,
    "attnlrp": 0.9,
    "ig": 0.8,
}
ROOT = Path(__file__).resolve().parents[1]
# Matrix products as the profiler names them (it counts their FLOPs); SDPA kernels apart.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
ATTENTION_PREFIX = "aten::_scaled_dot_product"
HF_DIR_NAME = "smollm2-135m-hf-transformers4-f32"


# ------------------------------------------------------------------------- memory bookkeeping
def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


# ------------------------------------------------------------------------- our side
def _our_calls(fast: bool) -> Any:
    import warnings

    import torch

    from lens_attrib.fastpath import disable_fast_forward, enable_fast_forward
    from lens_attrib.methods.registry import attribute
    from lens_attrib.models import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    (enable_fast_forward if fast else disable_fast_forward)(model)

    def call(kind: str, ids: list[int], opts: dict[str, Any]) -> None:
        tokens = torch.tensor([ids])
        if kind == "forward":
            with torch.no_grad():
                model(tokens)
        elif kind == "forward_last":
            with torch.no_grad():
                resid = model(tokens, stop_at_layer=model.cfg.n_layers)
                model.unembed(model.ln_final(resid[:, -1:]))
        elif kind == "ig":
            attribute(model, tokens, method="integrated_gradients", n_steps=opts["ig_steps"])
        else:
            attribute(model, tokens, method=kind)

    return call


# ------------------------------------------------------------------------- peer side
def _import_lxt_patch() -> Any:
    """LXT 2's ``lxt.efficient`` imports torchvision for its ViT map only; stub it if absent."""
    import importlib.machinery
    import importlib.util
    import types

    import torch
    import transformers  # noqa: F401  (before any stub, so transformers sees the real world)

    if importlib.util.find_spec("torchvision") is None:
        stubs = {
            name: types.ModuleType(name)
            for name in (
                "torchvision",
                "torchvision.models",
                "torchvision.models.vision_transformer",
            )
        }
        stubs["torchvision.models.vision_transformer"].nn = torch.nn  # type: ignore[attr-defined]
        for name, module in stubs.items():
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        sys.modules.update(stubs)
    from lxt.efficient import monkey_patch

    return monkey_patch


def _load_hf(hf_dir: str, gguf: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(hf_dir)
    if not (folder / "config.json").exists():
        gguf_path = Path(gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, torch_dtype=torch.float32
        )
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        os.replace(tmp, folder)
    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    model.requires_grad_(False)
    return model


def _peer_calls(side: str, hf_dir: str, gguf: str) -> Any:
    import torch

    if side == "lxt":
        from transformers.models.llama import modeling_llama

        _import_lxt_patch()(modeling_llama)  # AttnLRP (LXT's default map), module-global
    model = _load_hf(hf_dir, gguf)
    embed = model.get_input_embeddings()

    def top_logit(embeds: Any) -> Any:
        logits = model(inputs_embeds=embeds, use_cache=False, logits_to_keep=1).logits
        return logits[:, -1].max(-1).values

    def grad_x_input(ids: Any) -> Any:
        embeds = embed(ids).detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(top_logit(embeds).sum(), embeds)
        return (grad * embeds).sum(-1)

    def call(kind: str, ids_list: list[int], opts: dict[str, Any]) -> None:
        ids = torch.tensor([ids_list])
        if kind == "forward":
            with torch.no_grad():
                model(input_ids=ids, use_cache=False)
        elif kind == "forward_last":
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
        elif kind in ("grad_x_input", "attnlrp"):  # attnlrp: the LXT-patched process
            grad_x_input(ids)
        elif kind == "ig":
            from captum.attr import IntegratedGradients

            with torch.no_grad():
                embeds = embed(ids)
                target = int(
                    model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].argmax()
                )
            baseline = embed(torch.full_like(ids, opts["baseline_id"])).detach()
            baseline[:, 0] = embeds[:, 0]  # the first token (attention sink) is kept, as ours

            def forward(e: Any) -> Any:
                return model(inputs_embeds=e, use_cache=False, logits_to_keep=1).logits[
                    :, -1, target
                ]

            IntegratedGradients(forward).attribute(
                embeds,
                baselines=baseline,
                n_steps=opts["ig_steps"],
                internal_batch_size=opts["ig_batch"],
            )
        else:
            raise ValueError(f"unknown kind {kind!r}")

    return call


# ------------------------------------------------------------------------- worker process
def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # library prints go to stderr; stdout carries one JSON reply per line
    opts = json.loads(Path(args.opts).read_text())
    side = args.worker
    call = (
        _our_calls(fast=side == "ours")
        if side in ("ours", "ours_copy")
        else _peer_calls(side, opts["hf_dir"], opts["gguf"])
    )
    if args.profile:  # where one call's time goes, in this fresh process
        kind, length = args.profile[0], int(args.profile[1])
        out.write(json.dumps(_profile_call(call, kind, opts["ids"][:length], opts)) + "\n")
        return
    if args.once:  # peak memory of one call in this fresh process
        kind, length = args.once[0], int(args.once[1])
        gc.collect()
        loaded = _status_kb("VmRSS")  # the process with its model loaded, nothing run yet
        call(kind, opts["ids"][:8], opts)  # warm-up
        gc.collect()
        _reset_peak()
        before = _status_kb("VmRSS")
        call(kind, opts["ids"][:length], opts)
        peak = _status_kb("VmHWM")
        sizes = {"peak_extra_mb": (peak - before) / 1024, "peak_mb": peak / 1024}
        out.write(json.dumps({**sizes, "loaded_mb": loaded / 1024}))
        out.write("\n")
        return
    out.write(json.dumps({"ready": side}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        started = time.perf_counter()
        call(request["kind"], opts["ids"][: request["length"]], opts)
        out.write(json.dumps({"seconds": time.perf_counter() - started}) + "\n")


def _profile_call(call: Any, kind: str, ids: list[int], opts: dict[str, Any]) -> dict[str, float]:
    """One call under ``torch.profiler`` (after a warm-up call): self time of the matrix
    products (with the FLOPs the profiler counts for them), of the fused attention kernels, and
    of everything else."""
    from torch.profiler import ProfilerActivity, profile

    call(kind, ids, opts)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        call(kind, ids, opts)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul = [e for e in events if e.key in MATMUL_OPS]
    attention = [e for e in events if e.key.startswith(ATTENTION_PREFIX)]
    matmul_s = sum(e.self_cpu_time_total for e in matmul) / 1e6
    attention_s = sum(e.self_cpu_time_total for e in attention) / 1e6
    return {
        "total_s": total,
        "matmul_s": matmul_s,
        "matmul_gflop": sum(e.flops for e in matmul) / 1e9,
        "matmul_calls": sum(e.count for e in matmul),
        "attention_s": attention_s,
        "other_s": total - matmul_s - attention_s,
    }


def sgemm_rate(length: int, d_model: int = 576, d_mlp: int = 1536, reps: int = 20) -> float:
    """GFLOP/s of one thread on ``[length, d_model] @ [d_model, d_mlp]`` (the MLP's product at
    this length), best of ``reps``: what this core's BLAS reaches on the models' own shapes."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x, w = torch.randn(length, d_model), torch.randn(d_mlp, d_model)
        best = float("inf")
        for _ in range(reps + 3):
            started = time.perf_counter()
            torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return 2 * length * d_model * d_mlp / best / 1e9


# ------------------------------------------------------------------------- main process
class Worker:
    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.proc.args!r} died (see its stderr above)")
        return dict(json.loads(line))

    def seconds(self, kind: str, length: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"kind": kind, "length": length}) + "\n")
        self.proc.stdin.flush()
        return float(self._read()["seconds"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def _command(side: str, python: str, opts_file: str) -> list[str]:
    if side in ("ours", "ours_copy"):
        return [
            sys.executable,
            "-m",
            "benchmarks.bench_peers",
            "--worker",
            side,
            "--opts",
            opts_file,
        ]
    return [python, str(Path(__file__).resolve()), "--worker", side, "--opts", opts_file]


def _options(args: argparse.Namespace, opts_file: Path) -> dict[str, Any]:
    import warnings

    from lens_attrib.methods.baselines import special_token_id
    from lens_attrib.models import cache_root, load_model, smollm2_gguf_path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model("smollm2-135m")
    base = model.tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    longest = max([*args.lengths, args.ig_length])
    ids = (base * (longest // len(base) + 1))[:longest]  # every length T uses ids[:T]
    t = args.ig_length
    opts = {
        "ids": ids,
        "ig_steps": args.ig_steps,
        # the steps per forward our integrated_gradients chooses (its memory budget)
        "ig_batch": max(1, min(args.ig_steps, 2**12 // t, 2**19 // t**2)),
        "baseline_id": special_token_id(model, "pad"),
        "hf_dir": str(cache_root() / HF_DIR_NAME),
        "gguf": str(smollm2_gguf_path()),
    }
    opts_file.write_text(json.dumps(opts))
    return opts


def _jobs(args: argparse.Namespace) -> list[tuple[str, int]]:
    jobs = [(k, t) for t in args.lengths for k in ("forward", "forward_last", "grad_x_input")]
    jobs += [("attnlrp", t) for t in args.lengths]
    return jobs


def time_all(args: argparse.Namespace, opts_file: str, env: dict[str, str]) -> dict[str, Any]:
    workers = {side: Worker(_command(side, args.peer_python, opts_file), env) for side in SIDES}
    times: dict[str, list[float]] = {}
    try:
        schedule = [(job, args.reps) for job in _jobs(args)]
        schedule.append((("ig", args.ig_length), args.ig_reps))
        rounds = max(args.reps, args.ig_reps)
        for r in range(-1, rounds):  # round -1: warm-up, not recorded
            for (kind, length), reps in schedule:
                if r >= reps:
                    continue
                sides = ["ours", "ours_copy", PEER_OF[kind]]
                for side in sides if r % 2 else reversed(sides):
                    s = workers[side].seconds(kind, length if r >= 0 else min(length, 16))
                    if r >= 0:
                        times.setdefault(f"{side}|{kind}|{length}", []).append(s)
            print(f"round {r} done", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    return times


def memory_all(args: argparse.Namespace, opts_file: str, env: dict[str, str]) -> dict[str, Any]:
    peaks: dict[str, Any] = {}
    t_max = max(args.lengths)
    lengths = {"forward": t_max, "attnlrp": t_max, "grad_x_input": t_max, "ig": args.ig_length}
    for kind in args.memory_kinds:
        length = lengths[kind]
        for side in ("ours", "ours_copy", PEER_OF[kind]):
            command = [*_command(side, args.peer_python, opts_file), "--once", kind, str(length)]
            out = subprocess.run(
                command, check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
            )
            peaks[f"{side}|{kind}|{length}"] = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"memory {side} {kind} {length} done", file=sys.stderr, flush=True)
    return peaks


def profile_all(args: argparse.Namespace, opts_file: str, env: dict[str, str]) -> dict[str, Any]:
    profiles: dict[str, Any] = {}
    for kind in args.profile_kinds:
        for length in args.lengths:
            for side in ("ours", PEER_OF[kind]):
                command = [
                    *_command(side, args.peer_python, opts_file),
                    "--profile",
                    kind,
                    str(length),
                ]
                out = subprocess.run(
                    command, check=True, stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
                )
                profiles[f"{side}|{kind}|{length}"] = json.loads(
                    out.stdout.strip().splitlines()[-1]
                )
                print(f"profile {side} {kind} {length} done", file=sys.stderr, flush=True)
    for length in args.lengths:
        profiles[f"sgemm|{length}"] = {"gflop_per_s": sgemm_rate(length)}
    return profiles


def profile_report(profiles: dict[str, Any]) -> str:
    rows = [
        "| kind | T | side | profiled s | matrix products s (share) | their GFLOP | their GFLOP/s "
        "| SDPA kernels s | everything else s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, p in profiles.items():
        if key.startswith("sgemm|"):
            continue
        side, kind, length = key.split("|")
        rows.append(
            f"| {kind} | {length} | {side} | {p['total_s']:.3f} | {p['matmul_s']:.3f} "
            f"({p['matmul_s'] / p['total_s']:.0%}) | {p['matmul_gflop']:.1f} | "
            f"{p['matmul_gflop'] / p['matmul_s']:.1f} | {p['attention_s']:.3f} | "
            f"{p['other_s']:.3f} |"
        )
    rates = [
        f"T = {key.split('|')[1]}: {p['gflop_per_s']:.1f} GFLOP/s"
        for key, p in profiles.items()
        if key.startswith("sgemm|")
    ]
    if rates:
        rows.append("")
        rows.append("One thread's F.linear on [T, 576] x [576, 1536] here: " + "; ".join(rates))
    return "\n".join(rows)


def report(times: dict[str, list[float]], peaks: dict[str, Any]) -> str:
    rows = [
        "| kind | T | ours s | ours_copy s | peer s | ours ÷ peer | ours_copy ÷ peer | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {k.split("|", 1)[1] for k in times}, key=lambda k: (k.split("|")[0], int(k.split("|")[1]))
    )
    for key in keys:
        kind, length = key.split("|")
        peer = PEER_OF[kind]
        best = {s: min(times[f"{s}|{key}"]) for s in ("ours", "ours_copy", peer)}
        rows.append(
            f"| {kind} | {length} | {best['ours']:.3f} | {best['ours_copy']:.3f} | "
            f"{best[peer]:.3f} ({peer}) | {best['ours'] / best[peer]:.2f} | "
            f"{best['ours_copy'] / best[peer]:.2f} | ≤ {GOALS[kind]} |"
        )
    if peaks:
        rows += [
            "",
            "| kind | T | side | peak extra MB | peak total MB | resident after loading MB |",
            "|---|---|---|---|---|---|",
        ]
        for key, p in peaks.items():
            side, kind, length = key.split("|")
            rows.append(
                f"| {kind} | {length} | {side} | {p['peak_extra_mb']:.0f} | {p['peak_mb']:.0f} | "
                f"{p.get('loaded_mb', float('nan')):.0f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--peer-python", help="a Python with transformers<5, lxt and captum")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--ig-reps", type=int, default=3)
    parser.add_argument("--ig-steps", type=int, default=50)
    parser.add_argument("--ig-length", type=int, default=128)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument(
        "--no-time", action="store_true", help="peak memory only (not disturbed by other load)"
    )
    parser.add_argument(
        "--memory-kinds",
        nargs="+",
        choices=["forward", "attnlrp", "grad_x_input", "ig"],
        default=["forward", "attnlrp", "grad_x_input", "ig"],
        help="calls whose peak memory is measured (at the longest length; IG at --ig-length)",
    )
    parser.add_argument(
        "--profile-kinds",
        nargs="*",
        choices=["forward_last", "attnlrp", "grad_x_input"],
        default=[],
        help="also profile one call of these kinds per side (matrix products vs the rest; not "
        "IG: the profiler's records of its 50 steps took over 20 GB here)",
    )
    parser.add_argument("--out", default="results/bench_peers.json")
    parser.add_argument("--worker", choices=SIDES)
    parser.add_argument("--opts")
    parser.add_argument("--once", nargs=2, metavar=("KIND", "T"))
    parser.add_argument("--profile", nargs=2, metavar=("KIND", "T"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.peer_python:
        parser.error("--peer-python is required (a Python with transformers<5, lxt and captum)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    opts_file = out_path.with_suffix(".opts.json")
    opts = _options(args, opts_file)
    load = os.getloadavg()
    times = {} if args.no_time else time_all(args, str(opts_file), env)
    out_path.write_text(json.dumps({"times": times, "peaks": {}}, indent=1))  # kept if memory fails
    print(report(times, {}), file=sys.stderr, flush=True)
    peaks = {} if args.no_memory else memory_all(args, str(opts_file), env)
    profiles = profile_all(args, str(opts_file), env) if args.profile_kinds else {}
    table = report(times, peaks)
    if profiles:
        table += "\n\n" + profile_report(profiles)
    print(f"load average at start {load}, at end {os.getloadavg()} (interleaved rounds)")
    print(f"IG: {opts['ig_steps']} steps, {opts['ig_batch']} steps per forward on both sides")
    print(table)
    out_path.write_text(
        json.dumps(
            {"times": times, "peaks": peaks, "profiles": profiles, "load": [load, os.getloadavg()]},
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
