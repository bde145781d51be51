"""Test helpers shipped with the package: fakes, failing sources and tiers, proxies."""
