"""python -m kvcopy.bench: kvcopy against the ceiling and the alternatives."""
