"""vLLM 0.32's own CPU engine serving the trained EAGLE3 pair (testing/eagle3_heads.py): the
reference our plugin's eagle3 path is compared with (testing/vllm_native.py runs it). Prints JSON:
the generated token ids per prompt, vLLM's spec-decode counters, its mean acceptance length, and
whether its tokens equal transformers' greedy continuation on the taught target.

    python tools/vllm_eagle3_reference.py [-k 3] [--max-tokens 32] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-k", type=int, default=3, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    default_cache = Path.home() / ".cache" / "optimum-neuron-chunked" / "tests"  # the tests' cache
    parser.add_argument(
        "--cache-dir", type=Path, default=Path(os.environ.get("ONC_TEST_CACHE", default_cache))
    )
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    from optimum_neuron_chunked.testing.eagle3_heads import greedy, trained_pair
    from optimum_neuron_chunked.testing.vllm_native import mean_acceptance_length, native_eagle3

    target, head = trained_pair(args.cache_dir)
    manifest = json.loads((target.parent / "manifest.json").read_text())
    prompts = manifest["prompts"]
    result = native_eagle3(target, head, args.k, prompts, args.max_tokens)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reference = [greedy(hf, torch.tensor([p]), args.max_tokens)[0, len(p) :].tolist() for p in prompts]
    result |= dict(
        k=args.k,
        mean_acceptance_length=mean_acceptance_length(result["spec_decode"]),
        equals_transformers_greedy=result["tokens"] == reference,
        fixture_simulation=manifest["acceptance"],  # eagle3_heads.acceptance at its k, 32 tokens
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
