"""engine/device/stream.py: the kept Stream object is the current stream, inside a side-stream block
too, and an event it records follows the work of that stream (the uploader's buffer reuse rests on it)."""

from __future__ import annotations

import pytest
import torch

from engine.device.stream import current_stream, record

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_kept_stream_is_the_current_one_in_and_out_of_a_side_stream():
    index = torch.cuda.current_device()
    assert current_stream(index).cuda_stream == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(index).cuda_stream == side.cuda_stream
    assert current_stream(index).cuda_stream == torch.cuda.current_stream(index).cuda_stream
    assert current_stream(index) is current_stream(index)  # kept, not built again


def test_an_event_recorded_on_a_side_stream_waits_for_that_streams_work():
    device = torch.device("cuda")
    side = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    event = torch.cuda.Event()
    with torch.cuda.stream(side):
        for _ in range(20):  # long enough that the event is still pending when queried
            a = a @ a / 64
        record(event, device)
    assert not event.query()
    event.synchronize()
    assert side.query()
