"""Step tables: vLLM's real V1 scheduler driving the real worker and runner, step by step.

The export is llama-2x4x32-eager: 2 blocks, chunk 32, so the platform derives a token budget
of 64 tokens per step (the other block's decode plus a full chunk, rounded up to whole
chunks) and caps one request's share at a chunk: every chunk is full but a prompt's last.
"""

from __future__ import annotations

import pytest
import torch
from helpers import export_params, prompt
from vllm_stepper import EXPORT, XLA_EXPORT, Engine

from optimum_neuron_chunked.testing.reference import hf_greedy


@pytest.fixture(scope="module")
def engine_factory(export_dir):
    return lambda: Engine(export_dir)


@pytest.mark.parametrize("export_dir", export_params([EXPORT, XLA_EXPORT]), indirect=True)
def test_decodes_continue_between_the_chunks_of_a_long_prompt(export_dir, engine_factory, hf_reference):
    engine = engine_factory()
    a, b = prompt(5, seed=10), prompt(100, seed=11)
    engine.add("a", a, max_tokens=9)
    table = [engine.step(), engine.step()]
    engine.add("b", b, max_tokens=3)  # a long prompt arrives while a decodes
    while engine.scheduler.has_requests():
        table.append(engine.step())
    assert table == [
        "| a[0:5]",
        "a |",
        "a | b[0:32]",  # a's decode in every step beside a full chunk of b
        "a | b[32:64]",
        "a | b[64:96]",
        "a | b[96:100]",
        "a+b |",
        "a+b |",
        "a |",
        "",  # flushes the finished requests
    ]
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 9), "b": hf_greedy(hf, b, 3)}
    assert engine.free_blocks == 2


@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
def test_a_prompt_alone_runs_full_chunks_back_to_back(export_dir, engine_factory, hf_reference):
    """vLLM 0.32 gives a request running alone the whole budget (the per-request cap does not
    apply): two full chunks, never a one-token sliver. vLLM 0.16.0 caps it at one chunk a step."""
    from optimum_neuron_chunked.vllm.compat import LONE_PREFILL_TAKES_BUDGET

    engine = engine_factory()
    ids = prompt(70, seed=12)
    engine.add("a", ids, max_tokens=2)
    prefill = ["| a[0:32] a[32:64]"] if LONE_PREFILL_TAKES_BUDGET else ["| a[0:32]", "| a[32:64]"]
    for row in [*prefill, "| a[64:70]", "a |"]:
        assert engine.step() == row
    engine.step()
    assert engine.tokens["a"] == hf_greedy(hf_reference("llama"), ids, 2)


@pytest.mark.parametrize("export_dir", export_params([EXPORT, XLA_EXPORT]), indirect=True)
def test_abort_mid_prefill_frees_the_slot_for_a_queued_request(export_dir, engine_factory, hf_reference):
    engine = engine_factory()
    a, b, c = prompt(6, seed=13), prompt(90, seed=14), prompt(40, seed=15)
    engine.add("a", a, max_tokens=8)
    engine.add("b", b, max_tokens=4)
    engine.add("c", c, max_tokens=4)  # queued: both blocks are taken
    table = [engine.step(), engine.step()]
    engine.abort("b")
    while engine.scheduler.has_requests():
        table.append(engine.step())
    assert table[:4] == ["| a[0:6] b[0:32]", "a | b[32:64]", "a | c[0:32]", "a | c[32:40]"]
    assert "b" not in "".join(table[2:])
    hf = hf_reference("llama")
    assert engine.tokens["a"] == hf_greedy(hf, a, 8)
    assert engine.tokens["c"] == hf_greedy(hf, c, 4)  # c reuses b's block: nothing of b is read
    assert engine.tokens["b"] == []
    assert engine.free_blocks == 2


@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
def test_a_budget_above_the_chunk_runs_chunks_back_to_back_in_one_step(export_dir, hf_reference):
    """--max-num-batched-tokens >= the prompt: whole prompts per step, split by the runner
    (the runner-internal chunking of optimum-neuron, benchmark contender 3)."""
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(export_dir), dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_model_len=128,
        is_encoder_decoder=False,
        max_num_batched_tokens=160,
        long_prefill_token_threshold=128,
    )
    engine = Engine(export_dir, VllmConfig(model_config=model, scheduler_config=sched))
    a, b = prompt(4, seed=16), prompt(100, seed=17)
    engine.add("a", a, max_tokens=4)
    assert engine.step() == "| a[0:4]"
    engine.add("b", b, max_tokens=2)
    # a's next token waits for all four chunks of b
    assert engine.step() == "a | b[0:32] b[32:64] b[64:96] b[96:100]"
    while engine.scheduler.has_requests():
        engine.step()
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 4), "b": hf_greedy(hf, b, 2)}


def budget_engine(export_dir, budget: int) -> Engine:
    from vllm.config import ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(export_dir), dtype="float32", seed=0)
    sched = SchedulerConfig(
        max_model_len=128,
        is_encoder_decoder=False,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=budget,
        max_num_seqs=min(2, budget),  # vLLM wants a budget of at least one token per sequence
    )
    return Engine(export_dir, VllmConfig(model_config=model, scheduler_config=sched))


@pytest.mark.parametrize("export_dir", export_params([EXPORT, XLA_EXPORT]), indirect=True)
@pytest.mark.parametrize("budget", [1, 2, 32])
@pytest.mark.parametrize("reset_after", ["a-decoding-b-prefilling", "both-decoding"])
def test_recompute_after_a_reset_gives_the_transformers_tokens(export_dir, hf_reference, budget, reset_after):
    """reset_prefix_cache(reset_running_requests=True) preempts every running request; vLLM
    then recomputes prompt + outputs from position 0, in pieces the budget allows. Pieces
    that do not reach the last known token must not sample (nor run as decodes)."""
    engine = budget_engine(export_dir, budget)
    a, b = prompt(5, seed=18), prompt(100, seed=19)
    engine.add("a", a, max_tokens=12)
    engine.add("b", b, max_tokens=10)

    def ready() -> bool:
        if reset_after == "both-decoding":
            return len(engine.tokens["a"]) >= 3 and len(engine.tokens["b"]) >= 2
        b_request = engine.scheduler.requests["b"]
        return len(engine.tokens["a"]) >= 1 and 0 < b_request.num_computed_tokens < len(b)

    while not ready():
        engine.step()
    assert engine.scheduler.reset_prefix_cache(reset_running_requests=True)
    while engine.scheduler.has_requests():
        engine.step()
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 12), "b": hf_greedy(hf, b, 10)}
    assert engine.free_blocks == 2  # every block of the export's pool back, whatever --max-num-seqs


@pytest.mark.slow
@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
def test_the_runner_keeps_no_state_per_step(export_dir, engine_factory):
    """Memory our code retains does not grow with the number of steps served.

    What stays allocated between two snapshots is ~3 KiB whether 1000 or 3000 steps ran
    between them; a plan kept per step (~330 B each, the old `history`) retains ~1 MiB over
    3000 steps. CPython's type attribute cache (4096 entries) keeps a reference to the name
    of each attribute looked up, such as a layer's `k_cache_{i}`: up to ~140 KiB of strings
    our code allocated, bounded but not retained by it, so it is cleared before a snapshot."""
    import gc
    import sys
    import tracemalloc

    engine = engine_factory()

    def serve(steps: int) -> None:
        n = len(engine.tokens)
        for _ in range(steps):
            if not engine.scheduler.has_requests():
                for _ in range(2):
                    engine.add(f"r{n}", prompt(4, seed=n), max_tokens=100)
                    n += 1
            engine.step()
        while engine.scheduler.has_requests():
            engine.step()
        engine.tokens.clear()

    def ours() -> tracemalloc.Snapshot:
        gc.collect()  # count what is retained, not garbage awaiting collection
        sys._clear_type_cache()  # nor attribute names the interpreter's lookup cache holds
        return tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(True, "*optimum_neuron_chunked*")]
        )

    serve(150)  # warm up: first-call allocations, vLLM's caches
    tracemalloc.start()
    try:
        before = ours()
        serve(3000)
        after = ours()
    finally:
        tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert grown < 128 * 1024, (
        f"{grown} bytes retained over 3000 steps: {after.compare_to(before, 'lineno')[:3]}"
    )


@pytest.mark.parametrize("export_dir", export_params([EXPORT]), indirect=True)
@pytest.mark.parametrize("second_input", ["while-decoding", "after-the-turn"])
def test_a_streaming_input_session_continues_in_its_block(
    export_dir, engine_factory, hf_reference, second_input
):
    """A streaming-input session (AsyncLLM.generate with an async generator of inputs) re-adds
    its request id with each new input: vLLM keeps the KV block, drops the turn's last sampled
    token and resends the request as new, its prompt now prompt + kept outputs + new input,
    computed up to where the block's cache is valid. Another request decodes meanwhile.
    An input queued while the turn decodes is scheduled in the very next step."""
    from vllm.v1.request import RequestStatus

    engine = engine_factory()
    first, second, other = prompt(20, seed=20), prompt(40, seed=21), prompt(6, seed=22)
    engine.add("s", first, max_tokens=4, resumable=True)
    engine.add("o", other, max_tokens=30)
    engine.step_until(lambda: len(engine.tokens["s"]) >= (2 if second_input == "while-decoding" else 4))
    if second_input == "after-the-turn":
        engine.step()  # the session waits for input; o decodes alone
    engine.add("s", second, max_tokens=5, resumable=True)
    engine.step_until(lambda: len(engine.tokens["s"]) >= 4)
    turn1 = list(engine.tokens["s"][:4])
    session = engine.scheduler.requests["s"]
    # vLLM's scheduler decides how many tokens the second turn gets (5 on 0.32, 4 on 0.16.0);
    # they must be transformers'
    engine.step_until(lambda: session.status == RequestStatus.WAITING_FOR_STREAMING_REQ)
    turn2 = engine.tokens["s"][4:]
    engine.add("s", torch.tensor([0]), max_tokens=1)  # AsyncLLM's end-of-inputs request
    engine.step_until(lambda: not engine.scheduler.has_requests())
    hf = hf_reference("llama")
    assert turn1 == hf_greedy(hf, first, 4)
    context = torch.cat([first, torch.tensor(turn1[:-1]), second])
    assert len(turn2) >= 4 and turn2 == hf_greedy(hf, context, len(turn2))
    assert engine.tokens["o"] == hf_greedy(hf, other, 30)
    assert engine.free_blocks == 2
