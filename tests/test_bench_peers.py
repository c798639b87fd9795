"""The profile split of ``benchmarks.bench_peers``: what it counts as matrix products and FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.bench_peers import _profile_call, profile_report, sgemm_rate


def test_profile_call_counts_matrix_product_flops_and_splits_the_time():
    x, w = torch.randn(64, 32), torch.randn(48, 32)
    q = torch.randn(1, 2, 16, 8)

    def call(kind: str, ids: list[int], opts: dict) -> None:
        F.linear(x, w)  # one product, 2·64·32·48 FLOPs
        torch.relu(x)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)

    split = _profile_call(call, "grad_x_input", [], {})
    assert split["matmul_calls"] == 1
    assert split["matmul_gflop"] == pytest.approx(2 * 64 * 32 * 48 / 1e9)
    assert split["attention_s"] > 0
    parts = split["matmul_s"] + split["attention_s"] + split["other_s"]
    assert parts == pytest.approx(split["total_s"])


def test_profile_report_rows_and_rate():
    split = {
        "total_s": 2.0,
        "matmul_s": 1.5,
        "matmul_gflop": 45.0,
        "matmul_calls": 420,
        "attention_s": 0.1,
        "other_s": 0.4,
    }
    text = profile_report({"hf|grad_x_input|128": split, "sgemm|128": {"gflop_per_s": 33.0}})
    assert "| grad_x_input | 128 | hf | 2.000 | 1.500 (75%) | 45.0 | 30.0 | 0.100 | 0.400 |" in text
    assert "T = 128: 33.0 GFLOP/s" in text


def test_sgemm_rate_is_positive_and_keeps_the_thread_count():
    threads = torch.get_num_threads()
    assert sgemm_rate(16, reps=2) > 0
    assert torch.get_num_threads() == threads
