"""jitflow_server.store."""
