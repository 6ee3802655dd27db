"""The benchmark's package (bench/run.py, bench/layouts.py): kvcopy against the link's
ceiling and the alternatives. It lives beside kvcopy, not in its wheel; the scripts in
bench/ import it from there."""
