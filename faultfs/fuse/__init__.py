"""The pyfuse3 adapter (``ops``: 3-line handlers; ``handles``: the one handle table;
``invalidate``: kernel cache invalidation; ``serve``: the serving loop) and mountpoint
handling (``mountpoint``, usable without pyfuse3).

Nothing is imported here, so the CLI can use ``mountpoint`` without loading pyfuse3.
"""
