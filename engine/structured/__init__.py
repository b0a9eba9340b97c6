"""Structured output: grammar compilation, matcher state, and the matcher process that fills masks."""
