"""HDF5 read planning: what a reader of an HDF5 file reads next, found in the bytes it is served
(DESIGN §15, issue 46) — the chunks of a dataset from its chunk index (``lookahead``), a
group's next symbol table nodes (``grouplist``), the next members' object headers and the
structures an open reads one after another (``linkwalk``). No I/O here: the caller serves
the reads and fetches what this names, the daemon's engine for mounts and the ``faultfs::``
protocol for processes without one. ``Hdf5Lookahead`` is the face (``Stats``: where it counts).
"""

from faultfs.hdf5.lookahead import Hdf5Lookahead, Stats

__all__ = ["Hdf5Lookahead", "Stats"]
