"""Benchmarks (not tests): run each one as a script from the repo root, e.g.
``.venv/bin/python bench/store.py``. See bench/README.md."""
