"""Client-side analyses over engine observations (depth: LoopDuet state distances and layer-pass model)."""
