"""Speculative decoding: proposers, the speculator that schedules drafts, verification and its sampler."""
