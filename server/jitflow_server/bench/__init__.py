"""jitflow_server.bench."""
