"""vLLM's own CPU engine serving a target with an EAGLE3 head: the reference our eagle3 path's
acceptance is compared with (tests/test_vllm_eagle3.py, tools/vllm_eagle3_reference.py).

It runs in a subprocess of its own with our platform plugin deselected (`VLLM_PLUGINS=`), the
engine core in that process, a 1 GiB KV cache, --dtype float32 (vLLM's CPU engine would run a
float32 checkpoint in a lower precision otherwise) and eager (no torch.compile). Greedy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE_ENV = {"VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def native_eagle3(target: Path, head: Path, k: int, prompts: list[list[int]], max_tokens: int) -> dict:
    """{"tokens": generated ids per prompt, "spec_decode": vLLM's vllm:spec_decode_* counters
    (per-position ones as lists)}; raises RuntimeError with the end of vLLM's stderr."""
    with tempfile.TemporaryDirectory() as tmp:
        request, out = Path(tmp) / "request.json", Path(tmp) / "out.json"
        args = dict(target=str(target), head=str(head), k=k, prompts=prompts, max_tokens=max_tokens)
        request.write_text(json.dumps(dict(out=str(out), args=args)))
        proc = subprocess.run([sys.executable, "-m", __name__, str(request)], env=os.environ | NATIVE_ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM's native engine failed:\n{proc.stderr[-4000:]}")
        return json.loads(out.read_text())


def mean_acceptance_length(spec_decode: dict) -> float | None:
    """1 + accepted drafts per verify call, as vLLM's own log line computes it."""
    drafts = spec_decode.get("num_drafts") or 0
    return 1 + spec_decode.get("num_accepted_tokens", 0) / drafts if drafts else None


def _serve(target: str, head: str, k: int, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target, tokenizer=target, dtype="float32", max_model_len=256, seed=0,
        max_num_seqs=len(prompts), enforce_eager=True, disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": k},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counters = {
        m.name.removeprefix("vllm:spec_decode_"): getattr(m, "values", getattr(m, "value", None))
        for m in llm.get_metrics()
        if m.name.startswith("vllm:spec_decode")
    }
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], spec_decode=counters)


if __name__ == "__main__":
    request = json.loads(Path(sys.argv[1]).read_text())
    Path(request["out"]).write_text(json.dumps(_serve(**request["args"])))
