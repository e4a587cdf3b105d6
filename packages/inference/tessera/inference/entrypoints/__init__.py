"""Entry points: the tessera-serve and tessera-generate CLIs, the HTTP server, the request protocol."""
