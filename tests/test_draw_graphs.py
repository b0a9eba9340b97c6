"""engine/runner/draw_graphs.py: the packed draw inputs sit where the graph reads them (CPU), and a
replayed draw gives the ids of the eager draw, row for row (GPU)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine.runner.draw_graphs import DrawLayout
from engine.sampling.rows import SamplingRow
from engine.sampling.sampler import stream_key
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.engine


def test_the_layout_puts_each_segment_where_the_graph_reads_it():
    """Keys, counters and temperatures of 3 rows in a 4-row layout, then a 3-entry index: read back the
    way DrawGraphs._draw reads them (torch views of the int64 buffer), padding rows zero."""
    lay = DrawLayout(4)
    buf = np.full(lay.index_at + 3, -7, dtype=np.int64)  # stale contents everywhere
    lay.fill(buf, [11, 12, 2**62 + 5], [21, 22, 23], [0.5, 0.0, 1.25], [4, 5, 6])
    rows = torch.from_numpy(buf)
    assert rows[:4].tolist() == [11, 12, 2**62 + 5, 0]
    assert rows[4:8].tolist() == [21, 22, 23, 0]
    assert rows[lay.temps_at : lay.index_at].view(torch.float32).tolist() == [0.5, 0.0, 1.25, 0.0]
    assert rows[lay.index_at :].tolist() == [4, 5, 6]
    plain = np.full(lay.index_at, -7, dtype=np.int64)  # a decode step: no index segment
    lay.fill(plain, [1], [2], [0.7], ())
    temps = torch.from_numpy(plain)[lay.temps_at : lay.index_at].view(torch.float32)
    assert temps[0].item() == pytest.approx(0.7) and temps[1:].tolist() == [0.0] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,indexed", [(1, False), (5, False), (5, True), (37, True), (64, False)])
def test_a_replayed_draw_equals_the_eager_draw(tiny_model_dir, n: int, indexed: bool):
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.runner.cuda_graph import lm_head_rows, pad_rows

    engine = LLMEngine(
        EngineConfig.from_kwargs(str(tiny_model_dir), dtype="bfloat16", device="cuda", num_blocks=64)
    )
    runner = engine.runner
    assert runner.draw_graphs is not None
    rng = random.Random(n)
    hidden = torch.randn(200, runner.model_config.hidden_size, dtype=torch.bfloat16, device="cuda")
    index = sorted(rng.sample(range(200), n)) if indexed else None
    temps = [rng.choice([0.0, 0.7, 1.0, 1.3]) for _ in range(n)]
    rows = [
        SamplingRow(SamplingParams(temperature=t), [0], 1, key=stream_key(7, i), counter=50 + i)
        for i, t in enumerate(temps)
    ]
    for _ in range(2):  # a second replay over what the first left in the static buffers
        got = runner.draw_graphs.draw(runner.upload, hidden, index, rows).tolist()
    src = hidden[:n] if index is None else hidden[torch.tensor(index, device="cuda")]
    logits = runner.model.compute_logits(pad_rows(src, lm_head_rows(n)))[:n]
    assert got == runner.draw.sampler(logits, rows).resolve().token_ids
