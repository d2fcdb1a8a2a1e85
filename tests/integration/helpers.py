"""Re-exports the helpers shared by the Ray test directories (tests/ray_helpers.py)."""

from ray_helpers import (  # noqa: F401
    DISK_PAGES,
    HOST_PAGES,
    TIMEOUT_S,
    TPB,
    expected_route,
    get,
    index_view,
    poll,
    running,
    small_config,
    snapshot_view,
    tokens,
)
