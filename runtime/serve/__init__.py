"""Serving: the plan's engine behind an OpenAI-compatible HTTP API (app.py), one worker thread that
owns the engine and drains a bounded request queue (worker.py), incremental detokenization and stop
strings (text.py), the stand-in chat template (chat.py) and Prometheus metrics (metrics.py)."""
