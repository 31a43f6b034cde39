"""jitflow_server.api."""
