"""Tiny *trained* looped models: a deterministic synthetic task, a dense training forward over the engine's
own modules, and the trainer behind `looptrace train-tiny` (the weights shipped in `looptrace/assets/`)."""
