"""The benchmark harness: its pure latency figures, and the quick mode end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from metrics import Trace, summarize_load, summarize_stall  # noqa: E402


def test_a_stall_spanning_the_prefill_window_is_its_max_gap():
    # two streams at 10 ms/token; the long prompt arrives at t=1.0 and answers at t=1.5
    steady = [i * 0.01 for i in range(100)]  # up to 0.99
    stalled = steady + [1.52 + i * 0.01 for i in range(20)]
    streams = [Trace("s0", 4, 0.0, stalled), Trace("s1", 4, 0.0, list(stalled))]
    long = Trace("long", 3000, 1.0, [1.5, 1.51])
    figures = summarize_stall(streams, long)
    assert figures["prefill_window_s"] == pytest.approx(0.5)
    assert figures["itl_in_window"]["max"] == pytest.approx(0.53)
    assert figures["itl_before"]["p50"] == pytest.approx(0.01)
    assert figures["decode_tok_s_in_window"] == 0
    assert figures["decode_tok_s_before"] == pytest.approx(2 * 100 / 2.0)
    assert figures["long_ttft_s"] == pytest.approx(0.5)


def test_load_summary_counts_failures_and_throughput():
    ok = Trace("a", 10, 0.0, [0.2, 0.3, 0.4])
    failed = Trace("b", 10, 0.0, [], error="HTTP 400")
    figures = summarize_load([ok, failed], wall=1.0)
    assert figures["failed"] == 1 and figures["output_tok_s"] == 3
    assert figures["ttft"]["p50"] == pytest.approx(0.2)


@pytest.mark.slow
def test_quick_mode_produces_the_report(tmp_path):
    from serve_bench import main

    assert main(["--quick", "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("bench-quick-*.json")
    data = json.loads(report.read_text())
    assert set(data["contenders"]) == {"std", "chunked"}
    for result in data["contenders"].values():
        assert result["w2"][0]["failed"] == 0 and result["w1"][0]["long_ttft_s"] > 0
    assert len(list(tmp_path.glob("*.png"))) == 2 and list(tmp_path.glob("*.md"))


@pytest.mark.slow
def test_engine_quick_mode_produces_the_report(tmp_path):
    from engine_bench import main

    assert main(["--quick", "--repeats", "1", "--contenders", "std,chunked", "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("engine-*-quick.json")
    data = json.loads(report.read_text())
    for result in data["contenders"].values():
        (w1,), (w2,) = result["w1"], result["w2"]
        assert w1["long_ttft_s"] > 0 and w1["decode_step_ms_before"] > 0
        assert w2["failed"] == 0 and w2["requests"] == 8
    assert "W2 output tok/s" in (tmp_path / report.name.replace(".json", ".md")).read_text()


@pytest.mark.slow
def test_engine_quick_w5_reports_speculation_off_and_on(tmp_path):
    from engine_bench import SPEC_CONTENDERS, main

    assert main(["--quick", "--repeats", "1", "--workloads", "w5", "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("engine-*-quick.json")
    contenders = json.loads(report.read_text())["contenders"]
    assert set(contenders) == set(SPEC_CONTENDERS)
    for name, result in contenders.items():
        (w5,) = result["w5"]
        assert w5["failed"] == 0 and w5["tokens_per_step"] >= 1
        assert (w5["acceptance"] is None) == name.endswith("off")


@pytest.mark.slow
def test_eagle3_bench_reports_tok_s_and_acceptance(tmp_path):
    from eagle3_bench import main
    from fixtures.export_models import cache_root  # the trained pair the EAGLE3 tests keep

    argv = ["--repeats", "1", "--max-tokens", "8", "--contenders", "eagle3-2", "--backend", "eager"]
    assert main([*argv, "--work", str(cache_root()), "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("eagle3-*.json")
    (run,) = json.loads(report.read_text())["runs"]["eagle3-2"]
    assert all(run[c]["tok_s"] > 0 and run[c]["acceptance_length"] > 1 for c in ("1", "4"))


@pytest.mark.slow
def test_prefix_cache_quick_mode_reports_hits_and_the_copy_graph(tmp_path):
    from prefix_cache import main

    argv = ["--quick", "--contenders", "ours-on", "--workloads", "shared-warm"]
    assert main([*argv, "--work", str(tmp_path / "work"), "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("prefix-*-quick.json")
    data = json.loads(report.read_text())
    (run,) = data["runs"]["shared-warm"]["ours-on"]
    assert run["hit_rate_pct"] > 0 and run["ttft_ms_p50"] > 0 and run["steps"] > 0
    assert data["copy_cost"]["ms"] and all(ms > 0 for ms, _, _ in data["copy_cost"]["ms"].values())
    assert "shared-warm | ours-on" in (tmp_path / report.name.replace(".json", ".md")).read_text()


@pytest.mark.slow
def test_long_context_quick_mode_reports_export_prefill_and_decode(tmp_path):
    from long_context import main

    assert main(["--quick", "--work", str(tmp_path / "work"), "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("w3-*-quick.json")
    data = json.loads(report.read_text())
    assert [(r["seq"], r["graph"]) for r in data["rows"]] == [(256, "CE"), (256, "CP")]
    for row in data["rows"]:
        assert row["export_s"] > 0 and row["prefill_s"] > 0 and row["decode_step_ms"]
        assert all(ms > 0 for ms in row["decode_step_ms"].values())
    assert data["read_gb_s"] > 0 and list(tmp_path.glob("w3-*-quick-memory.png"))


@pytest.mark.slow
def test_export_report_quick_mode_matches_hf(tmp_path):
    from export_report import main

    assert main(["--quick", "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("export-*-quick.json")
    rows = json.loads(report.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"std", "chunked"}
    assert all(r["greedy_equal_hf"] and r["weights_mb"] > 0 for r in rows)


def test_neuron_projection_writes_its_tables(tmp_path):
    from neuron_projection import main

    assert main(["--contexts", "512,8192", "--tokens-per-call", "2", "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("neuron-projection-*.json")
    data = json.loads(report.read_text())
    assert [r["context"] for r in data["rows"]] == [512, 8192]
    for row in data["rows"]:
        assert 0 < row["tg"]["ms"] < row["paged_tg"]["ms"] and 0 < row["saved"] < 1
    assert data["w4"]["tok_s_ratio"] > 0
    assert "decode tok/s on / off" in (tmp_path / report.name.replace(".json", ".md")).read_text()


def test_export_memory_quick_mode_reports_every_setting(tmp_path):
    from export_memory import main

    assert main(["--quick", "--scratch", str(tmp_path), "--results", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("export-memory-*-quick.json")
    rows = json.loads(report.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["bf16", "int8", "fp8"]
    assert all(r["peak_gib"] > 0 and r["seconds"] > 0 for r in rows)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []  # scratch deleted


def test_perplexity_of_an_int8_export_is_transformers_on_its_weights_and_near_the_source(tmp_path):
    """perplexity.py scores windows through the prompt-logits path: on an export it equals
    transformers on the same weights (fp32); a quantized export's sits near its source's."""
    from fixtures.export_models import checkpoint_path, export_with
    from perplexity import main

    from optimum_neuron_chunked.testing.checkpoints import CORPUS

    shape = dict(batch_size=1, sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128))
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS * 3))
    model = str(checkpoint_path("llama"))
    figures = {}
    for quantization in ("", "int8"):
        out = export_with("llama", "eager", prompt_logprobs=True, quantization=quantization, **shape)
        assert (
            main(
                [
                    str(out),
                    "--text",
                    str(text),
                    "--model",
                    model,
                    "--window",
                    "100",
                    "--results",
                    str(tmp_path),
                ]
            )
            == 0
        )
        (report,) = tmp_path.glob("perplexity-*.json")
        figures[quantization] = json.loads(report.read_text())
    assert figures[""]["windows"] > 1 and figures[""]["export_ppl"] > 1
    assert figures[""]["export_ppl"] == pytest.approx(figures[""]["reference_ppl"], rel=1e-4)
    assert figures["int8"]["export_ppl"] != figures[""]["export_ppl"]
    assert figures["int8"]["ratio"] == pytest.approx(1, abs=0.05)
    assert figures[""]["reference"] == "transformers"


def test_perplexity_of_an_fp8_checkpoint_is_against_transformers_weight_only_dequantization(tmp_path, capsys):
    """An FP8_DYNAMIC checkpoint (compressed-tensors' API): the reference is transformers'
    weight-only dequantization of the same checkpoint, the export's own math, named in the line."""
    from fixtures.export_models import fp8_checkpoint_path
    from perplexity import main

    from optimum_neuron_chunked.export.pipeline import export
    from optimum_neuron_chunked.testing.checkpoints import CORPUS

    source = fp8_checkpoint_path("llama", "FP8_DYNAMIC")
    out = export(str(source), tmp_path / "out", backend="eager", prompt_logprobs=True, batch_size=1,
                 sequence_length=128, prefill_chunk_size=32, context_buckets=(64, 128))  # fmt: skip
    text = tmp_path / "text.txt"
    text.write_text(" ".join(CORPUS * 3))
    main(
        [str(out), "--text", str(text), "--model", str(source), "--window", "100", "--results", str(tmp_path)]
    )
    assert "transformers, FP8 weights dequantized (weight-only) on" in capsys.readouterr().out
    (report,) = tmp_path.glob("perplexity-*.json")
    assert json.loads(report.read_text())["ratio"] == pytest.approx(1, rel=1e-4)


@pytest.mark.slow
def test_verify_proxy_tiny_runs_on_cpu(tmp_path):
    from verify_proxy import main

    # the graphs' own inputs (graphs.example_inputs): block tables [rows, ceil(W / P)]
    argv = ["--tiny", "--device", "cpu", "--buckets", "512,2048", "--replays", "3"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    (report,) = tmp_path.glob("verify-proxy-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [r["bucket"] for r in rows] == [512, 2048]
    assert all(r["tg_ms"] > 0 and r["vf_ms"] > 0 and r["ratio"] > 0 for r in rows)
