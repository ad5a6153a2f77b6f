"""`pgmesh run` as a service: `supervisor` (starts and stops sources, appliers and the progress tick),
`admin` (the admin listener and the client the CLI uses), `metrics` (every metric and its rendering).
"""
