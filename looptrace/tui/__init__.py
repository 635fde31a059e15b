"""`looptrace top`: a live Textual dashboard for a looptrace server, a vLLM Prometheus endpoint or a replay.

Textual is imported only here (and by `looptrace top` / `serve --tui`), never by the engine or the probes.
"""
