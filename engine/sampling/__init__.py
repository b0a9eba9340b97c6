"""Sampling the next token from logits: temperature, top-k/top-p, seeds, logprobs."""
