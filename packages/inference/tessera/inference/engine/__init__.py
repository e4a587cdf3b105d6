"""The engine: its step loop, its process and the client to it, output processing, metrics."""
