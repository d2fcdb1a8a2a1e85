"""The transfer paths (``shm``, ``ucx``, ``direct``, ``gpu_peer``, ``gpu_read``, ``shm_read``),
their client and server interfaces, their registry, and the import of pulled pages. Imports
:mod:`raykv.transfer.pages` and :mod:`raykv.transfer.net`, never the page client or server."""
