"""faultfs: mount big, slow or remote data and copy nothing until a byte is touched."""

__version__ = "0.1.0"
