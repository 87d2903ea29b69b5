"""Benchmarks against torch's own implementations: ``python -m benchmarks`` (``nox -s bench``).

Each ``bench_<name>.py`` module compares one of our packages with torch on a
small model and prints tables with ratio columns; ``common.py`` holds the
shared machinery (launching ranks, timing, memory, tables) and ``gpt.py`` the
model. How to add a benchmark is in ``common.py``'s docstring.
"""
