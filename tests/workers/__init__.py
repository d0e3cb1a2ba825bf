"""Programs the multi-process tests start (`python -m tests.workers.NAME`), one per rank."""
