"""Paths as users run them (psql, pgbench, the `pgmesh` command line), each ending in a convergence check
that compares every table, keyless ones included, and every node's schema (`users.py`)."""
