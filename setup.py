"""The package list, found rather than listed (pyproject.toml holds everything else). It is here
because pyproject's `packages.find` cannot rename a folder: gc/ is imported as `layergc` (CPython's
built-in gc always wins over a package named gc), so gc/ and its subpackages go in under that name."""

from setuptools import find_packages, setup

NOT_SHIPPED = ["tests", "tests.*", "bench", "bench.*", "build", "build.*"]
packages = find_packages(exclude=[*NOT_SHIPPED, "gc", "gc.*"])
packages += ["layergc", *(f"layergc.{p}" for p in find_packages("gc"))]

setup(packages=packages)
