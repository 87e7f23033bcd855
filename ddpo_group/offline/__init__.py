"""The commands beside training, each on a run's config or its results: the pre-flight check (scripts/check.py:
preflight.py) and the base-vs-fine-tuned comparison (scripts/evaluate.py: comparison.py). They build on run/ and
nothing in run/ imports them."""
