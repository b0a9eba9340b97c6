"""GPU check of speculative decoding: greedy outputs equal plain decoding's, token for token.

    python -m scripts.spec_gpu_check MODEL_DIR

float32 weights on the GPU (verification scores positions with the varlen attention kernel and plain
decoding with the decode kernel; in float32 their rounding differences never flip an argmax of the
random checkpoints used here). Prints one line per proposer and exits 1 on any difference.
"""

from __future__ import annotations

import random
import sys


def main(model: str) -> int:
    from engine import LLM, SamplingParams

    rng = random.Random(0)
    base = [rng.randrange(100, 2000) for _ in range(64)]
    prompts = [base * 2 + [rng.randrange(100, 2000) for _ in range(rng.randint(1, 64))] for _ in range(12)]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 16}
    ref = [r.outputs[0].token_ids for r in LLM(model, **kw).generate(prompts, sp)]
    bad = 0
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": model, "num_speculative_tokens": 3}):  # fmt: skip
        llm = LLM(model, speculative_config=spec, **kw)
        out = [r.outputs[0].token_ids for r in llm.generate(prompts, sp)]
        stats = {k: v for k, v in llm.engine.get_stats().items() if k.startswith("spec")}
        same = sum(a == b for a, b in zip(out, ref))
        print(f"{spec['method']}: {same}/{len(ref)} equal, audit {llm.engine.audit()}, {stats}", flush=True)
        bad += same != len(ref) or bool(llm.engine.audit())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
