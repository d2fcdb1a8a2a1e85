"""Pages in flight: a peer's mapped shared tier, a lease's payload chunks, the receiving side's
checksums, what a pull returns, and landing pulled pages through the caller's import. Imports only
:mod:`raykv.transfer.net` of raykv.transfer."""
