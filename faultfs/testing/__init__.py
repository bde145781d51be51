"""Test helpers shipped with the package: fakes, failing sources and tiers, proxies.

Importable by faultfs's own tests and by anyone writing a plugin or embedding the engine:
``faultfs.testing.fakes`` (in-memory sources and their assimilator, engines over them),
``faultfs.testing.crashfs`` (file operations that forget unsynced writes at a "crash"),
``faultfs.testing.model`` (the engine model), ``faultfs.testing.proxy`` (a latency,
bandwidth and fault-injecting HTTP proxy), ``faultfs.testing.stamps`` (writers that stamp
and log their writes, and the point-in-time check of a snapshot against their logs). Nothing in the product imports this package.
"""
