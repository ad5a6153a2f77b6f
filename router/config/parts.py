"""The checks of a node's part of the data (`tables`, `rows`, `columns` under `[[nodes]]`) that need no
server: router.config.rules runs them at parse; router.cluster.partial checks the rest on the node at init.

Must not: import router.config.model or router.config.rules (they import this), or connect anywhere.
"""

from __future__ import annotations

from router.config.sections import NodeConfig

__all__ = ["describe_part", "part_problem"]


def part_problem(node: NodeConfig) -> tuple[str, str] | None:
    """What is wrong with `node`'s part (a message, and the key under the node), or None.

    Only a receive-only node holds part of the data: a node that sends and lacks rows would send changes
    of rows the others hold and it does not (a partial node converges only as the end of one-way links).
    Every name is `schema.table`; no filter, list or table set is empty."""
    given = {"tables": node.tables, "rows": node.rows, "columns": node.columns}
    for field, names in given.items():
        if (names or (field == "tables" and names is not None)) and not node.receive_only:
            return f"node {node.name} sends: only a receive_only node can hold part of the data", field
        for name in names or ():
            if name.count(".") != 1 or "" in name.split("."):
                return f"{name!r}: name the table as schema.table", field
    if node.tables is not None and not node.tables:
        return "an empty table list: leave `tables` out for every replicated table", "tables"
    for name, text in node.rows.items():
        if not text.strip():
            return f"an empty row filter for {name}", "rows"
    for name, cols in node.columns.items():
        if not cols or len(set(cols)) != len(cols):
            return f"the column list of {name} is empty or names a column twice", "columns"
    if node.tables is not None:
        for field in ("rows", "columns"):
            for name in sorted(set(given[field] or ()) - set(node.tables)):
                return f"{name} is not in this node's tables", field
    return None


def describe_part(node: NodeConfig) -> str:
    """What `node` holds, for status ("": everything it is sent)."""
    said = [f"only {', '.join(node.tables)}"] if node.tables is not None else []
    said += [f"rows of {name} where {text}" for name, text in node.rows.items()]
    said += [f"columns {', '.join(cols)} of {name}" for name, cols in node.columns.items()]
    return "; ".join(said)
