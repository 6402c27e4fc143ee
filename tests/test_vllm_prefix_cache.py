"""Prefix caching: vLLM's real scheduler asks our connector for cached prefixes, schedules only
the rest, and the runner copies the prefix into the new request's block before the step's
graphs. Step tables show what was copied and computed; tokens equal HF's greedy tokens on the
whole prompt (the copied K/V must be exactly what computing it would have written).

llama-2x4x32-eager: 2 blocks, chunk 32, budget 64 tokens per step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import export_params, prompt
from vllm_stepper import EXPORT, XLA_EXPORT, Engine

from optimum_neuron_chunked.testing.reference import hf_greedy
from optimum_neuron_chunked.vllm.compat import LONE_PREFILL_TAKES_BUDGET


class CachingEngine(Engine):
    def step(self) -> str:
        """'copy 0->1[0:96] | b[96:116]': the step's prefix copies, decodes | chunks."""
        table = super().step()
        plan = self.worker.runner.last_plan
        if plan is None or not plan.copies:
            return table
        copies = " ".join(f"copy {c.source}->{c.target}[0:{c.length}]" for c in plan.copies)
        return f"{copies} {table}"

    def run(self) -> list[str]:
        table = []
        while self.scheduler.has_requests():
            table.append(self.step())
        return table


def joined(*parts) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p) for p in parts])


@pytest.fixture
def engine(export_dir):
    return CachingEngine(export_dir)


pytestmark = pytest.mark.parametrize("export_dir", export_params([EXPORT, XLA_EXPORT]), indirect=True)


def test_a_shared_three_chunk_prefix_schedules_only_the_suffix(engine, hf_reference):
    system = prompt(96, seed=30)  # three chunks
    a, b = joined(system, prompt(10, seed=31)), joined(system, prompt(20, seed=32))
    engine.add("a", a, max_tokens=8)
    table = [engine.step(), engine.step(), engine.step()]
    engine.add("b", b, max_tokens=2)  # while a decodes in block 0
    table += engine.run()
    # the prefix from a's live block, only the suffix computed
    shared = ["a |", "copy 0->1[0:96] a | b[96:116]", "a+b |"]
    if LONE_PREFILL_TAKES_BUDGET:
        assert table[:5] == ["| a[0:32] a[32:64]", "| a[64:96] a[96:106]", *shared]
    else:  # one chunk a step: b arrives while a still prefills
        assert table[:3] == ["| a[0:32]", "| a[32:64]", "| a[64:96]"]
        assert table[3] == "copy 0->1[0:96] | a[96:106] b[96:116]"
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 8), "b": hf_greedy(hf, b, 2)}
    assert engine.free_blocks == 2


def test_a_finished_request_leaves_its_prefix_in_its_block(engine, hf_reference):
    """Block affinity: the next request lands in the free block that holds its prefix."""
    system = prompt(96, seed=30)
    a, b = joined(system, prompt(10, seed=31)), joined(system, prompt(20, seed=32))
    engine.add("a", a, max_tokens=2)
    engine.run()
    engine.add("b", b, max_tokens=2)
    assert engine.run() == ["| b[96:116]", "b |", ""]  # no copy: b is in a's block
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 2), "b": hf_greedy(hf, b, 2)}


def test_partial_hits_mid_chunk_and_the_prompt_repeated(engine, hf_reference):
    a = prompt(70, seed=33)
    b = joined(a[:45], prompt(30, seed=34))  # diverges mid-chunk
    engine.add("a", a, max_tokens=3)
    engine.run()
    engine.add("b", b, max_tokens=3)
    assert engine.run()[0] == "| b[45:75]"  # b in a's block (block 0), 45 tokens cached
    # nothing shared: the block freed longest ago (1), not the one b just left (vLLM's choice)
    engine.add("keep", prompt(20, seed=42), max_tokens=30)
    engine.step()
    engine.add("c", a, max_tokens=3)  # a again: block 0 still holds b, i.e. a's first 45 tokens
    assert engine.step() == "keep | c[45:70]"
    while len(engine.tokens["c"]) < 3:
        engine.step()
    d = joined(a[:50], prompt(5, seed=43))
    engine.add("d", d, max_tokens=3)  # c's block (0) holds a now
    assert engine.step() == "keep | d[50:55]"
    engine.run()
    hf = hf_reference("llama")
    for req_id, ids in {"a": a, "b": b, "c": a, "d": d}.items():
        assert engine.tokens[req_id] == hf_greedy(hf, ids, 3), req_id


def test_multi_turn_reuses_the_generated_tokens(engine, hf_reference):
    """A chat's next turn sends prompt + answer + new message: the answer's K/V is cached too."""
    a = prompt(40, seed=35)
    engine.add("a", a, max_tokens=6)
    engine.run()
    turn = joined(a, engine.tokens["a"], prompt(12, seed=36))
    engine.add("b", turn, max_tokens=4)
    # a's last token never went through the decoder (it was sampled, not fed): 40 + 5 cached
    assert engine.run()[0] == "| b[45:58]"
    assert engine.tokens["b"] == hf_greedy(hf_reference("llama"), turn, 4)


def test_a_chat_turn_after_an_unrelated_request_finds_its_history(engine, hf_reference):
    """LRU eviction: an unrelated request takes the block freed longest ago. vLLM alone would
    hand it the block freed last - the chat's - and the next turn would compute it all again."""
    a = prompt(40, seed=60)
    engine.add("a", a, max_tokens=6)
    engine.run()
    engine.add("x", prompt(30, seed=61), max_tokens=2)
    engine.run()
    turn = joined(a, engine.tokens["a"], prompt(12, seed=62))
    engine.add("b", turn, max_tokens=4)
    assert engine.run()[0] == "| b[45:58]"  # no copy: b is in a's block, only the new message computed
    hf = hf_reference("llama")
    assert engine.tokens["b"] == hf_greedy(hf, turn, 4)
    assert engine.free_blocks == 2


def test_a_miss_and_a_source_slot_reused_in_between(engine, hf_reference):
    system = prompt(64, seed=37)
    a = joined(system, prompt(8, seed=38))
    engine.add("a", a, max_tokens=2)
    engine.run()  # block 0 holds a
    x, y = prompt(50, seed=39), prompt(50, seed=40)  # misses: nothing shared
    engine.add("x", x, max_tokens=2)
    engine.add("y", y, max_tokens=2)
    table = engine.run()  # x and y take both blocks: a's K/V is overwritten
    assert not any("copy" in row for row in table)
    b = joined(system, prompt(8, seed=41))
    engine.add("b", b, max_tokens=2)
    # a miss: a's prefix is gone from both blocks
    assert engine.run()[0] == ("| b[0:32] b[32:64]" if LONE_PREFILL_TAKES_BUDGET else "| b[0:32]")
    hf = hf_reference("llama")
    for req_id, ids in {"a": a, "x": x, "y": y, "b": b}.items():
        assert engine.tokens[req_id] == hf_greedy(hf, ids, 2), req_id


def test_two_requests_admitted_in_one_step_share_a_finished_prefix(engine, hf_reference):
    system = prompt(96, seed=44)
    a = joined(system, prompt(7, seed=45))
    b, c = joined(system, prompt(20, seed=46)), joined(system, prompt(20, seed=47))
    engine.add("a", a, max_tokens=2)
    engine.run()
    engine.add("b", b, max_tokens=3)
    engine.add("c", c, max_tokens=3)
    # b lands in a's block (no copy); c's copy reads block 0 before b's chunk writes it
    assert engine.run()[0] == "copy 0->1[0:96] | b[96:116] c[96:116]"
    hf = hf_reference("llama")
    for req_id, ids in {"a": a, "b": b, "c": c}.items():
        assert engine.tokens[req_id] == hf_greedy(hf, ids, 3 if req_id != "a" else 2), req_id


def test_a_request_aborted_in_its_copy_step_leaves_a_valid_block(engine, hf_reference):
    system = prompt(96, seed=48)
    a, b = joined(system, prompt(10, seed=49)), joined(system, prompt(20, seed=50))
    engine.add("a", a, max_tokens=12)
    while not engine.tokens["a"]:
        engine.step()
    engine.add("b", b, max_tokens=4)
    assert engine.step() == "copy 0->1[0:96] a | b[96:116]"
    engine.abort("b")  # its block holds the copied prefix and the suffix it computed
    engine.add("c", b, max_tokens=4)  # b's prompt again: all but its last token is in block 1
    assert engine.step() == "a | c[115:116]"
    engine.run()
    hf = hf_reference("llama")
    assert engine.tokens["a"] == hf_greedy(hf, a, 12)
    assert engine.tokens["c"] == hf_greedy(hf, b, 4)
    assert engine.free_blocks == 2


def test_prompt_logprobs_requests_read_no_cached_prefix(engine):
    """vLLM's own rule (SamplingParams.skip_reading_prefix_cache, 0.32): the scheduler drops a
    connector's hit for a request that wants the logprobs of every prompt token."""
    from vllm import SamplingParams

    a = prompt(70, seed=51)
    engine.add("a", a, max_tokens=2)
    engine.run()
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    engine.add_request("b", a, params)
    so = engine.scheduler.schedule()
    assert so.num_scheduled_tokens == {"b": 64 if LONE_PREFILL_TAKES_BUDGET else 32}  # from position 0


def test_a_request_waits_for_a_shared_prefix_another_is_computing(engine, hf_reference):
    """b arrives with a, sharing a's first three chunks: rather than compute them twice (and
    take budget from a every step), b waits until a has them, then copies them."""
    system = prompt(96, seed=52)
    a, b = joined(system, prompt(20, seed=53)), joined(system, prompt(10, seed=54))
    engine.add("a", a, max_tokens=3)
    engine.add("b", b, max_tokens=3)
    table = engine.run()
    assert table[:5] == [
        "| a[0:32]",  # b waits: a is computing 96 tokens of b's prompt
        "| a[32:64]",
        "| a[64:96]",
        "copy 0->1[0:96] | a[96:116] b[96:106]",  # then b copies them and computes its own
        "a+b |",
    ]
    hf = hf_reference("llama")
    assert engine.tokens == {"a": hf_greedy(hf, a, 3), "b": hf_greedy(hf, b, 3)}
