"""What a transfer path is: :class:`TransferPath`, and what the paths may use of a page client.

A path is one way pages move from an owner to a puller; each has a class with its wire and stats
name (``name``):

- ``shm_read`` (:class:`raykv.transfer.paths.shm_read.ShmReadPath`): a one-sided read of a same-node
  peer's shared host tier, no request.
- ``gpu_read`` (:class:`raykv.transfer.paths.gpu_read.GpuReadPath`): a one-sided copy from a same-node
  peer's mapped GPU tier, no request.
- ``shm`` (:class:`raykv.transfer.paths.host.ShmPath`): the server leases, the client copies from
  its mapping of the server's shared host tier.
- ``ucx`` (:class:`raykv.transfer.paths.host.UcxPath`): the payload as a few large UCX messages
  into host memory, CRC-32 checked.
- ``direct`` (:class:`raykv.transfer.paths.direct.DirectPath`): UCX into the puller's top-tier device,
  digests checked there.
- ``gpu_peer`` (:class:`raykv.transfer.paths.gpu_peer.GpuPeerPath`): the server leases, the client
  copies from its mapping of the owner's GPU tier.

Server side, :class:`raykv.transfer.server.PageServer` leases the blocks of a pull and hands it to
the path named in the request (:meth:`TransferPath.serve`, through a
:class:`raykv.transfer.paths.serving.ServerConn`), falling back to ``ucx`` when that path does not
:meth:`TransferPath.accepts` the pull. Client side, each path pulls through a
:class:`raykv.transfer.paths.pull_client.PullClient` (what it may use of a
:class:`raykv.transfer.client.PageClient`) and a :class:`raykv.transfer.net.connection.ClientConn`.

Direction of imports: the path modules import this module, the connections and the lower
modules; :mod:`raykv.transfer.paths.registry` (the registry) imports the path modules; the server and the
client import the registry. No path module imports the server or the client.
"""

from __future__ import annotations

from typing import ClassVar

from raykv.core.errors import TransferError, TransferFailure
from raykv.transfer.paths.serving import PullRequest, ServerConn


class TransferPath:
    """One transfer path (see the module docstring). Subclasses set ``name``; a path that a page
    server answers overrides :meth:`serve` (and :meth:`accepts` when it cannot serve every pull);
    a one-sided path (``one_sided``) is never asked of a server."""

    name: ClassVar[str]
    one_sided: ClassVar[bool] = False

    def accepts(self, conn: ServerConn, pull: PullRequest) -> bool:
        """Whether this server can answer ``pull`` on this path (else it goes over ``ucx``)."""
        return not self.one_sided

    async def serve(self, conn: ServerConn, pull: PullRequest) -> None:
        """Answer ``pull`` on ``conn``: header, payload, the client's ``done``. The server holds
        ``pull.lease`` until this returns or raises; a path that let UCX read leased pages aborts
        its endpoint before it raises (:meth:`ServerConn.drop_endpoint`). TransferError for any
        failure (the server counts it and tells the client)."""
        raise TransferError(f"the {self.name} path is not served", reason=TransferFailure.UNAVAILABLE)
