"""jitflow_server.engine."""
