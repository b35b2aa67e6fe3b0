"""Rank loading and the engine: a program on one rank, the step contract, paged KV cache, host metadata, the greedy / speculative / prefix-cached loops."""
