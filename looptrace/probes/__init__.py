"""Probes: trace analysis (events → classification → counters → report), independent of the engine."""
