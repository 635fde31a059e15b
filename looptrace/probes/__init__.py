"""Probes: observe the engine through its hooks and analyse what it ran.

`ranges` (NVTX + record_function ranges attached as an engine Observer and module hooks) and `session`
(profiling windows over a live engine) drive the engine; `events` → `classify` → `counters` → `report`
read a Kineto/Chrome trace and need no engine, so `looptrace trace analyze` works on vLLM's or SGLang's
traces too.
"""
