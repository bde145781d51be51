"""The standing torture suite (``scripts/torture``): real mounts killed, filled, starved, fed a
failing source and hostile bytes, each case checked against what must hold.

``python -m faultfs.testing.torture [--quick] [--only CASE ...]`` runs it and prints one table
(case, trials, operations, what held, what failed); the exit status is 1 if anything failed.
docs/reliability.md describes every case and keeps the figures of the last full run.

Modules: ``harness`` (the private temporary directory, mounts through the CLI, cleanup that
survives Ctrl-C), ``workers`` (reader and writer processes run against a mount),
``writeops`` (the seeded write script shared by the writer and its verifier), ``httpd`` (a
loopback HTTP server that honours Range), ``decoders`` (the fuzz targets), ``crossname_model``
and ``crossname_workers`` (the cross-name case's layout, model and processes), ``watchdog``
(a hang turned into a failure with the stacks, the mount freed), one ``case_*`` module per
case, and ``main`` (the command line and the table). Nothing here imports
``tests/``, and nothing in the product imports this package.
"""
