"""Client scripts the partition tests run inside a network namespace (tests/netns.py).

Each prints one JSON object a line on stdout (``{"event": ..., "t": time.monotonic(), ...}``;
the monotonic clock is the machine's, shared with the test) and stops when its stdin closes.
"""
