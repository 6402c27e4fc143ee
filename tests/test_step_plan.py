"""The pure step planner: decodes vs prefill chunks, splitting, sampling flags, refusals."""

from __future__ import annotations

import pytest

from optimum_neuron_chunked.vllm.step_plan import PlanError, ScheduledWork, plan_step


def work(req_id, block, start, n, prompt, known=None, first=100):
    return ScheduledWork(req_id, (block,), start, tuple(range(first, first + n)), prompt, known or prompt)


def sampling(plan) -> list[str]:
    """Requests that get a token from the step: its decodes and its last chunks."""
    return [d.req_id for d in plan.decodes] + [c.req_id for c in plan.chunks if c.samples]


def test_decodes_and_a_partial_chunk():
    plan = plan_step(
        [work("a", 0, 10, 1, prompt=8, known=11), work("b", 1, 0, 20, prompt=50)], chunk_size=32, batch_size=4
    )
    assert [(d.req_id, d.blocks, d.position) for d in plan.decodes] == [("a", (0,), 10)]
    assert [(c.req_id, c.start, len(c.token_ids), c.samples) for c in plan.chunks] == [("b", 0, 20, False)]
    assert sampling(plan) == ["a"]


def test_long_piece_is_split_into_chunks_and_only_the_last_samples():
    plan = plan_step([work("b", 2, 40, 70, prompt=110)], chunk_size=32, batch_size=4)
    assert [(c.start, len(c.token_ids), c.samples) for c in plan.chunks] == [
        (40, 32, False),
        (72, 32, False),
        (104, 6, True),
    ]
    assert plan.chunks[1].token_ids[0] == 132  # tokens stay with their positions
    assert sampling(plan) == ["b"]


def test_single_token_prompt_is_a_prefill_not_a_decode():
    plan = plan_step([work("a", 0, 0, 1, prompt=1)], chunk_size=32, batch_size=4)
    assert plan.decodes == () and plan.chunks[0].samples


def test_one_token_recompute_piece_that_does_not_sample_is_prefill():
    """After a reset vLLM recomputes prompt + outputs from position 0; under a small budget a
    one-token piece can sit past the prompt but before the last known token."""
    plan = plan_step([work("b", 1, 5, 1, prompt=4, known=9)], chunk_size=32, batch_size=2)
    assert plan.decodes == ()
    assert [(c.start, len(c.token_ids), c.samples) for c in plan.chunks] == [(5, 1, False)]
    assert sampling(plan) == []
    plan = plan_step([work("b", 1, 8, 1, prompt=4, known=9)], chunk_size=32, batch_size=2)
    assert [(d.position, d.req_id) for d in plan.decodes] == [(8, "b")] and plan.chunks == ()


def test_standard_export_takes_whole_prompts_only():
    plan = plan_step([work("a", 0, 0, 90, prompt=90)], chunk_size=0, batch_size=4)
    assert len(plan.chunks) == 1 and len(plan.chunks[0].token_ids) == 90
    with pytest.raises(PlanError, match="whole prompts"):
        plan_step([work("a", 0, 0, 40, prompt=90)], chunk_size=0, batch_size=4)


def test_refuses_oversized_decode_batches():
    decodes = [work(str(i), i, 9, 1, 8, 10) for i in range(3)]
    with pytest.raises(PlanError, match="batch_size 2"):
        plan_step(decodes, chunk_size=32, batch_size=2)
