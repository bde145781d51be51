"""S3 tests (a package, so this directory's conftest does not shadow tests/conftest.py)."""
