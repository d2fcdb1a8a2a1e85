"""Build hook for the optional compiled extensions (everything else is in pyproject.toml).

``raykv._keytable`` speeds up the prefix index's lookups (:mod:`raykv.keytable`),
``raykv._shmread`` same-node one-sided pulls (:mod:`raykv.transfer.shm_read`) and ``raykv._chain``
the building of imported pages and blocks (:mod:`raykv.page`, :mod:`raykv.radix`); where they
cannot be compiled (no C compiler or Python headers) the install goes on without them and the
index uses a dict, the one-sided reads and the imports Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("raykv._keytable", ["raykv/_keytable.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("raykv._shmread", ["raykv/_shmread.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("raykv._chain", ["raykv/_chain.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
