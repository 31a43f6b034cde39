"""Integrations of jitflow with agent frameworks (each imports its framework only when used)."""
