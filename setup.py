"""Build hook for the optional compiled key table (everything else is in pyproject.toml).

``raykv._keytable`` speeds up the prefix index's lookups (:mod:`raykv.keytable`); where it cannot
be compiled (no C compiler or Python headers) the install goes on without it and the index uses a
dict.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("raykv._keytable", ["raykv/_keytable.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
