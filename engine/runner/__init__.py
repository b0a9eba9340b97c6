"""Running a scheduled step on the device: step inputs, model runner, CUDA graphs, KV cache, draft model."""
