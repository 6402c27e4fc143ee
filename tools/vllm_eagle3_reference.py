"""vLLM 0.32's own CPU engine serving the trained EAGLE3 pair (testing/eagle3_heads.py): the
reference our plugin's eagle3 path is compared with. Greedy; prints JSON: the generated token ids
per prompt, vLLM's spec-decode counters (vllm:spec_decode_*), its mean acceptance length, and
whether its tokens equal transformers' greedy continuation on the taught target.

    python tools/vllm_eagle3_reference.py [-k 3] [--max-tokens 32] [--cache-dir DIR]

vLLM runs in a subprocess of its own with our platform plugin deselected (VLLM_PLUGINS=), the
engine core in that process, a 1 GiB KV cache and --dtype float32.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NATIVE_ENV = {"VLLM_PLUGINS": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def default_cache() -> Path:  # the tests' cache (tests/fixtures/export_models.cache_root)
    return Path(os.environ.get("ONC_TEST_CACHE", Path.home() / ".cache" / "optimum-neuron-chunked" / "tests"))


def serve(target: str, head: str, k: int, prompts: list[list[int]], max_tokens: int, eager: bool) -> dict:
    """In the vLLM process: generate, then read the spec-decode counters."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=target, tokenizer=target, dtype="float32", max_model_len=256, seed=0,
        max_num_seqs=len(prompts), enforce_eager=eager, disable_log_stats=False,
        speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": k},
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode"):
            counters[m.name.removeprefix("vllm:spec_decode_")] = getattr(
                m, "values", getattr(m, "value", None)
            )
    return dict(tokens=[list(o.outputs[0].token_ids) for o in outs], spec_decode=counters)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", type=Path, default=default_cache())
    parser.add_argument("--compile", action="store_true", help="vLLM's torch.compile (default: eager)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the vLLM subprocess: a JSON request
    args = parser.parse_args()
    if args.serve:
        req = json.loads(Path(args.serve).read_text())
        Path(req["out"]).write_text(json.dumps(serve(**req["args"])))
        return 0

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    from optimum_neuron_chunked.testing.eagle3_heads import greedy, trained_pair

    target, head = trained_pair(args.cache_dir)
    manifest = json.loads((target.parent / "manifest.json").read_text())
    prompts = manifest["prompts"]
    with tempfile.TemporaryDirectory() as tmp:
        req, out = Path(tmp) / "req.json", Path(tmp) / "out.json"
        served = dict(target=str(target), head=str(head), k=args.k, prompts=prompts,
                      max_tokens=args.max_tokens, eager=not args.compile)  # fmt: skip
        req.write_text(json.dumps(dict(out=str(out), args=served)))
        proc = subprocess.run([sys.executable, __file__, "--serve", str(req)], env=os.environ | NATIVE_ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        if proc.returncode != 0:
            print(json.dumps({"error": proc.stderr[-4000:]}, indent=1))
            return 1
        result = json.loads(out.read_text())
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = [greedy(hf, torch.tensor([p]), args.max_tokens)[0, len(p) :].tolist() for p in prompts]
    sd = result["spec_decode"]
    drafts = sd.get("num_drafts") or 0
    result |= dict(
        k=args.k,
        mean_acceptance_length=1 + sd.get("num_accepted_tokens", 0) / drafts if drafts else None,
        equals_transformers_greedy=result["tokens"] == reference,
        fixture_simulation=manifest["acceptance"],  # eagle3_heads.acceptance at its k, 32 tokens
        mismatched_prompts=[
            i for i, (a, b) in enumerate(zip(result["tokens"], reference, strict=True)) if a != b
        ],
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
