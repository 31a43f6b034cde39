"""jitflow_server.tracker."""
