"""Pure core: bytes and ints in, values out. No file system, network, threads or event loop.

A test fails the build if any module here imports an I/O module.
"""
