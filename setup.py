"""Build hook for the one C extension, ``kvpoold.alloc._ledger`` (the allocator's hot loop).

Everything else is in pyproject.toml. The extension is optional: without a C compiler the
package still installs and ``kvpoold.alloc.ledger`` falls back to numpy (same behaviour,
slower per call; the daemon's "serving" log line says which is in use). Set
``KVPOOL_REQUIRE_NATIVE=1`` to make a failed compile fail the install (CI and the Docker
images do).
"""

import os

from setuptools import Extension, setup

REQUIRED = os.environ.get("KVPOOL_REQUIRE_NATIVE") == "1"

setup(
    ext_modules=[
        Extension(
            "kvpoold.alloc._ledger",
            ["service/kvpoold/alloc/_ledger.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=not REQUIRED,
        )
    ]
)
