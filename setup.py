"""Build hook for the optional compiled extensions (everything else is in pyproject.toml).

``raykv.native._holders`` holds the prefix index's table (:mod:`raykv.index.holders`),
``raykv.native._shmread`` same-node one-sided pulls (:mod:`raykv.transfer.paths.shm_read`) and ``raykv.native._chain``
the building of imported pages and blocks (:mod:`raykv.core.page`, :mod:`raykv.core.radix`) and the
keying of prompts (:mod:`raykv.routing.session_keys`), and ``raykv.native._cost`` the routing
decision's cost loop (:mod:`raykv.routing.policy`); where they
cannot be compiled (no C compiler or Python headers) the install goes on without them and the
index uses its pure-Python table, the one-sided reads and the imports Python.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "raykv.native._holders",
            ["raykv/native/_holders.c", "raykv/native/_holders_read.c"],
            depends=["raykv/native/holders.h"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension("raykv.native._shmread", ["raykv/native/_shmread.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("raykv.native._chain", ["raykv/native/_chain.c"], optional=True, extra_compile_args=["-O3"]),
        # no contraction into fused multiply-adds: its costs must equal Python's, float for float
        Extension(
            "raykv.native._cost",
            ["raykv/native/_cost.c"],
            optional=True,
            extra_compile_args=["-O3", "-ffp-contract=off"],
        ),
        Extension("raykv.native._slots", ["raykv/native/_slots.c"], optional=True, extra_compile_args=["-O3"]),
        Extension("raykv.native._gather", ["raykv/native/_gather.c"], optional=True, extra_compile_args=["-O3"]),
    ]
)
