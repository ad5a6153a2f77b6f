"""`pgmesh run` as a service: the router process and what it runs beside the data path.

`supervisor` runs the router (every long-lived task, the progress tick, the hold for a join, the
ordered shutdown) over the parts `wiring` builds from the config and the nodes (sources, links, their
progress, the watchers). Watchers beside the links: `clocks` (each node's clock offset; the links'
future-commit guard and clock hold), `monitor` (the monitoring connection to each node: flushed origin
progress, paused links, retained WAL), `logs` (each source's router log as the run keeps it), `lease`
(the standby router's lease, [ha]), `synchronous` (confirming at each commit for `synchronous` = k),
`verify` (continuous verification, [verify]: the tables compared across nodes in rolling ranges).
What it reports: `report` (status and /metrics from the router's parts), `status` (the plain data of
`pgmesh status`), `metrics` (every metric and its rendering). The admin surface: `admin` (the
listener), `admintoken` (the token a changing request carries), `adminclient` (the CLI's side of it).
`tasks` holds the task lifecycle helpers.

Must not: decide what a link applies or how (router.apply), or run an operator command (router.ops).
"""
