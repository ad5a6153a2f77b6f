"""What an operator runs: `cli` (argument parsing only), `control` (init, run, status, pause, resume,
conflicts, sequences), `demo` (`pgmesh demo` over throw-away local nodes).
"""
