"""Clients that drive the engine: workload generators, the benchmark driver and vLLM-style serving metrics.

They see the engine only through `protocol.ServingEngine` (the public API of `looptrace.engine.LLMEngine`),
so a test can drive them with any object of that shape and the engine never imports them.
"""
