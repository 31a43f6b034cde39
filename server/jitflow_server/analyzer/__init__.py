"""jitflow_server.analyzer."""
