"""Serving on many replicas with Ray Serve: the ingress, the replicas and their options, and routing a prompt to
the replica whose cache holds its prefix."""
