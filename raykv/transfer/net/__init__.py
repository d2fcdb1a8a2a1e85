"""The wire under every transfer path: settings, framing, authentication, the UCX runtime, a
client's control connection and the server's guards. Imports nothing else of raykv.transfer."""
