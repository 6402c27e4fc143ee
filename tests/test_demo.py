"""The demo's stall metrics, from recorded steps (no engine)."""

from __future__ import annotations

from optimum_neuron_chunked.demo_stall import Run, Step


def steps(*rows: tuple[float, dict[str, int]]) -> list[Step]:
    return [Step(ms, "", tokens) for ms, tokens in rows]


def test_a_prefill_in_one_step_stalls_every_stream_for_that_step():
    streams = {"stream0": 1, "stream1": 1, "stream2": 1}
    run = Run(
        "standard", steps((5, {}), (10, streams), (700, streams | {"long": 1}), (10, streams)), arrival=2
    )
    assert run.first_long_token() == 2
    assert run.long_ttft_ms() == 700
    assert run.longest_stream_gap_ms() == 700
    assert run.stream_tokens_while_prefilling() == 3


def test_chunks_beside_decodes_keep_the_streams_going():
    streams = {"stream0": 1, "stream1": 1, "stream2": 1}
    run = Run(
        "chunked", steps((10, streams), (40, streams), (45, streams), (42, streams | {"long": 1})), arrival=1
    )
    assert run.long_ttft_ms() == 127
    assert run.longest_stream_gap_ms() == 45
    assert run.stream_tokens_while_prefilling() == 9


def test_a_stream_that_misses_steps_waits_their_sum():
    run = Run("x", steps((10, {"stream0": 1}), (30, {}), (20, {"stream0": 1, "long": 1})), arrival=1)
    assert run.longest_stream_gap_ms() == 50
