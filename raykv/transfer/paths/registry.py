"""The registry of transfer paths (:mod:`raykv.transfer.paths.base`): which class answers which name.

The page server answers a pull on ``server_paths(...)[name]`` (``ucx`` when the name is unknown or
the path does not accept the pull); the page client receives and lands a batch on
``REQUEST_PATHS[header.path]``. This module imports every path module; the server and the client
import this module, and no path module imports either of them.
"""

from __future__ import annotations

from types import MappingProxyType

from raykv.transfer.net.config import TransferConfig
from raykv.transfer.paths.base import TransferPath
from raykv.transfer.paths.direct import DirectPath
from raykv.transfer.paths.gpu_peer import GpuPeerExport, GpuPeerPath
from raykv.transfer.paths.gpu_read import GpuReadPath
from raykv.transfer.paths.host import ShmPath, UcxPath
from raykv.transfer.paths.shm_read import ShmReadPath

PATH_CLASSES: tuple[type[TransferPath], ...] = (
    ShmReadPath,
    GpuReadPath,
    ShmPath,
    UcxPath,
    DirectPath,
    GpuPeerPath,
)
"""Every path, one-sided first (the order a client tries them in)."""

REQUEST_PATHS: MappingProxyType[str, ShmPath | UcxPath] = MappingProxyType(
    {ShmPath.name: ShmPath(), UcxPath.name: UcxPath()}
)
"""The client side of the paths a server may answer a plain pull on (``PageClient.pull``)."""


def server_paths(
    shm_level: int, config: TransferConfig, gpu_export: GpuPeerExport
) -> dict[str, TransferPath]:
    """One page server's paths by name: ``shm`` from its shared host tier at ``shm_level`` (-1:
    none), ``gpu_peer`` through ``gpu_export``; one-sided paths are listed (they accept nothing)."""
    made: list[TransferPath] = [
        ShmReadPath(),
        GpuReadPath(),
        ShmPath(shm_level, config.use_shm),
        UcxPath(),
        DirectPath(),
        GpuPeerPath(gpu_export),
    ]
    return {path.name: path for path in made}
