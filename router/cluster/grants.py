"""What the role that runs `pgmesh run` needs on a node when it is not a superuser: the GRANTs a DBA
runs (`grant_statements`), and the check that each privilege and each object of pgmesh is there
(`check_run_role`, `pgmesh init --check`). docs/security.md says why each one is needed.

The role needs: LOGIN and REPLICATION (the replication connection, the slot); EXECUTE on every
`pg_replication_origin_*` function (the appliers set their origin up in each transaction, create the
early-apply and recorder origins, advance one at a join); SELECT on `pg_replication_origin_status` and
EXECUTE on the function behind it (positions in status and at start); SET on `session_replication_role`
(PostgreSQL 15+: the appliers run as `replica`, so user triggers and foreign keys do not fire twice);
USAGE on the `pgmesh` schema and CREATE (the appliers create their decision functions there,
`router.apply.decide`), SELECT, INSERT, UPDATE, DELETE on its tables, USAGE and UPDATE on its sequences,
EXECUTE on its functions; SELECT, INSERT, UPDATE, DELETE, TRUNCATE on every replicated table.

Must not: install or alter pgmesh's objects (`router.cluster.install`), change a role itself (it
only writes the SQL a DBA runs), or put a DSN or a password into a message. Identifiers are quoted
with `psycopg.sql.Identifier`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

import psycopg
from psycopg import sql

from router.cluster.checks import Check, InitReport, TableName, connect, replicated_tables
from router.config.model import PGMESH_SCHEMA, Config, NodeConfig
from router.errors import PgmeshError, describe
from router.nodes.connect import Conn

__all__ = ["OWNERS_SQL", "TABLE_PRIVILEGES", "check_run_role", "grant_statements", "run_role_of"]

TABLE_PRIVILEGES: Final = ("SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE")
PGMESH_TABLE_PRIVILEGES: Final = ("SELECT", "INSERT", "UPDATE", "DELETE")
ORIGIN_FUNCTIONS: Final = r"pg\_replication\_origin\_%"
# behind the view pg_replication_origin_status: a SELECT of the view calls it as the caller
ORIGIN_STATUS_FUNCTION: Final = "pg_show_replication_origin_status"
# not PUBLIC's on a pgmesh node (router/cluster/sql/ddl_as_owner.sql): the appliers' applied marks and
# the progress barriers (router.apply.link, router.progress.positions) write messages
EMIT_FUNCTION: Final = "pg_logical_emit_message"
SET_PARAMETER_SINCE: Final = 150000  # GRANT SET ON PARAMETER
SET_OPTION_SINCE: Final = 160000  # GRANT role TO role WITH SET
PLUGINS_SQL: Final = "SELECT pg_catalog.current_setting('output_plugin_libraries', true)"
# The roles (no superuser) that own the replicated tables: replayed DDL runs as them.
OWNERS_SQL: Final = (
    "SELECT DISTINCT r.rolname FROM unnest(%s::text[], %s::text[]) t(s, n)"
    " JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(pg_catalog.format('%%I.%%I', t.s, t.n))"
    " JOIN pg_catalog.pg_roles r ON r.oid = c.relowner WHERE NOT r.rolsuper ORDER BY 1"
)
_ROLE_SQL: Final = "SELECT rolsuper, rolreplication, rolcanlogin FROM pg_catalog.pg_roles WHERE rolname = %s"
_ORIGIN_FUNCTIONS_SQL: Final = (
    "SELECT p.oid::regprocedure::text, pg_catalog.has_function_privilege(%s, p.oid, 'EXECUTE')"
    " FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'pg_catalog'::regnamespace"
    " AND (p.proname LIKE %s OR p.proname = %s OR p.proname = %s)"
    " ORDER BY 1"
)
# Every table, sequence and function of the pgmesh schema, and what the role may do with each.
_PGMESH_OBJECTS_SQL: Final = """
SELECT 'table', c.relname, p.priv, pg_catalog.has_table_privilege(%(role)s, c.oid, p.priv)
FROM pg_catalog.pg_class c, unnest(%(table_privs)s::text[]) p(priv)
WHERE c.relnamespace = pg_catalog.to_regnamespace(%(schema)s) AND c.relkind IN ('r', 'p')
UNION ALL
SELECT 'sequence', c.relname, p.priv, pg_catalog.has_sequence_privilege(%(role)s, c.oid, p.priv)
FROM pg_catalog.pg_class c, unnest(ARRAY['USAGE', 'UPDATE']) p(priv)
WHERE c.relnamespace = pg_catalog.to_regnamespace(%(schema)s) AND c.relkind = 'S'
UNION ALL
SELECT 'function', f.oid::regprocedure::text, 'EXECUTE',
       pg_catalog.has_function_privilege(%(role)s, f.oid, 'EXECUTE')
FROM pg_catalog.pg_proc f WHERE f.pronamespace = pg_catalog.to_regnamespace(%(schema)s)
ORDER BY 1, 2, 3
"""


def run_role_of(node: NodeConfig) -> str:
    """The role the node's DSN connects as (libpq's meaning: the DSN, else PGUSER, else the OS user)."""
    from router.nodes.dsn import libpq_params

    return libpq_params(node.dsn).get("user", "")


def grant_statements(role: str, database: str, tables: Sequence[TableName], server_version: int,
                     owners: Sequence[str] = ()) -> list[str]:
    """The SQL a superuser runs on one node so that `role` can run the router there (after init); `owners`:
    the roles (no superuser) that own the replicated tables, whose DDL the router replays as them."""
    who = sql.Identifier(role)
    schema = sql.Identifier(PGMESH_SCHEMA)
    out = [
        sql.SQL("ALTER ROLE {} WITH LOGIN REPLICATION").format(who),
        sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(sql.Identifier(database), who),
        sql.SQL(  # every origin function of this server's version (their arguments differ across versions)
            "DO $grant$ DECLARE f regprocedure; BEGIN FOR f IN SELECT oid::regprocedure"
            " FROM pg_catalog.pg_proc WHERE pronamespace = 'pg_catalog'::regnamespace"
            " AND (proname LIKE {pattern} OR proname = {status} OR proname = {emit}) LOOP"
            " EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %I', f, {role}); END LOOP;"
            " END $grant$"
        ).format(pattern=sql.Literal(ORIGIN_FUNCTIONS), status=sql.Literal(ORIGIN_STATUS_FUNCTION),
                 emit=sql.Literal(EMIT_FUNCTION),
                 role=sql.Literal(role)),
        sql.SQL("GRANT SELECT ON pg_catalog.pg_replication_origin_status TO {}").format(who),
    ]
    if server_version >= SET_PARAMETER_SINCE:
        out.append(sql.SQL("GRANT SET ON PARAMETER session_replication_role TO {}").format(who))
    out += [
        sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(schema, who),
        sql.SQL("GRANT {} ON ALL TABLES IN SCHEMA {} TO {}").format(
            sql.SQL(", ").join(sql.SQL(p) for p in PGMESH_TABLE_PRIVILEGES), schema, who),
        sql.SQL("GRANT USAGE, UPDATE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(schema, who),
        sql.SQL("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {} TO {}").format(schema, who),
    ]
    schemas = sorted({s for s, _ in tables})
    if schemas:
        out.append(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
            sql.SQL(", ").join(sql.Identifier(s) for s in schemas), who))
    if tables:
        out.append(sql.SQL("GRANT {} ON TABLE {} TO {}").format(
            sql.SQL(", ").join(sql.SQL(p) for p in TABLE_PRIVILEGES),
            sql.SQL(", ").join(sql.Identifier(*t) for t in tables), who))
    if schemas:  # tables a superuser creates later (replayed DDL included): the router applies into them
        inner = (f"ALTER DEFAULT PRIVILEGES FOR ROLE %I IN SCHEMA"
                 f" {', '.join(sql.Identifier(s).as_string(None) for s in schemas)}"
                 f" GRANT {', '.join(TABLE_PRIVILEGES)} ON TABLES TO %I")
        out.append(sql.SQL(
            "DO $grant$ DECLARE r name; BEGIN FOR r IN SELECT rolname FROM pg_catalog.pg_roles WHERE rolsuper"
            " LOOP EXECUTE pg_catalog.format({inner}, r, {role}); END LOOP; END $grant$"
        ).format(inner=sql.Literal(inner), role=sql.Literal(role)))
    # replayed DDL runs as its author (SET ROLE): the run role becomes a member of the tables' owners
    # (WITH SET on 16+, where a membership may lack it); a superuser's runs through pgmesh.ddl_as_owner
    option = sql.SQL(" WITH SET TRUE") if server_version >= SET_OPTION_SINCE else sql.SQL("")
    for owner in sorted(set(owners) - {role}):
        out.append(sql.SQL("GRANT {} TO {}{}").format(sql.Identifier(owner), who, option))
    # pgmesh's DDL capture (once installed) leaves these on this node
    body = [statement.as_string(None) + ";" for statement in out]
    return ["BEGIN;", "SET LOCAL pgmesh.ddl_local = on;", *body, "COMMIT;"]


# ---------------------------------------------------------------------------------------------------------
# Checking a node as the run role


def _missing(node: str, what: str, privilege: str, fix: str, relation: str | None = None) -> Check:
    return Check(node, "privilege", False, f"{what}: role lacks {privilege}", relation, fix)


async def _plugin_checks(conn: Conn, node: str) -> list[Check]:
    """Where the server lists the decoding plugins a role without superuser may use
    (`output_plugin_libraries`: 18.6 and the same minor releases of 15-17), pgoutput must be among them:
    the router's replication connection names it (refused at run time otherwise). Only superusers and
    members of pg_read_all_settings may read the list: for others, a warning says what to make sure of."""
    try:
        row = await (await conn.execute(PLUGINS_SQL)).fetchone()
    except psycopg.errors.InsufficientPrivilege:
        return [Check(node, "output_plugin_libraries", True, "the role may not read output_plugin_libraries:"
                      " make sure it lists pgoutput (where the server has it)", warn=True,
                      hint="SHOW output_plugin_libraries as a superuser; or GRANT pg_read_all_settings to the"
                      " role and run the check again")]
    allowed = row[0] if row else None
    if allowed is None or "pgoutput" in {part.strip() for part in str(allowed).split(",")}:
        return []
    listed = ", ".join(p for p in (str(allowed).strip(), "pgoutput") if p)
    fix = f"ALTER SYSTEM SET output_plugin_libraries = '{listed}'; SELECT pg_reload_conf() (as a superuser)"
    return [Check(node, "output_plugin_libraries", False, f"output_plugin_libraries = {allowed!r} does not"
                  " allow pgoutput, which the router's replication connection uses", hint=fix)]


async def _role_checks(conn: Conn, node: str, role: str) -> list[Check]:
    row = await (await conn.execute(_ROLE_SQL, [role])).fetchone()
    assert row is not None
    superuser, replication, login = (bool(v) for v in row)
    if superuser:
        return [Check(node, "role", True, f"{role} is a superuser: every privilege")]
    checks = [Check(node, "role", True, f"{role} is not a superuser; checking each privilege it needs")]
    for ok, attribute in ((replication, "REPLICATION"), (login, "LOGIN")):
        if not ok:
            fix = f"ALTER ROLE {sql.Identifier(role).as_string(None)} WITH {attribute}"
            checks.append(_missing(node, f"role {role}", f"the {attribute} attribute", fix))
    who = sql.Identifier(role).as_string(None)
    params = [role, ORIGIN_FUNCTIONS, ORIGIN_STATUS_FUNCTION, EMIT_FUNCTION]
    functions = await (await conn.execute(_ORIGIN_FUNCTIONS_SQL, params)).fetchall()
    for function, ok in functions:
        if not ok:
            fix = f"GRANT EXECUTE ON FUNCTION pg_catalog.{function} TO {who}"
            checks.append(_missing(node, f"function {function}", "EXECUTE", fix))
    status = "SELECT pg_catalog.has_table_privilege(%s, 'pg_catalog.pg_replication_origin_status', 'SELECT')"
    if not (await (await conn.execute(status, [role])).fetchone() or (False,))[0]:
        fix = f"GRANT SELECT ON pg_catalog.pg_replication_origin_status TO {who}"
        checks.append(_missing(node, "view pg_replication_origin_status", "SELECT", fix))
    checks += await _plugin_checks(conn, node)
    if conn.info.server_version >= SET_PARAMETER_SINCE:
        query = "SELECT pg_catalog.has_parameter_privilege(%s, 'session_replication_role', 'SET')"
        if not (await (await conn.execute(query, [role])).fetchone() or (False,))[0]:
            fix = f"GRANT SET ON PARAMETER session_replication_role TO {who}"
            checks.append(_missing(node, "parameter session_replication_role", "SET", fix))
    return checks


async def _object_checks(conn: Conn, node: str, role: str, config: Config) -> list[Check]:
    """pgmesh's objects on the node (schema, slot, origins) and the role's rights on the schema's."""
    who = sql.Identifier(role).as_string(None)
    checks: list[Check] = []
    cur = await conn.execute(
        "SELECT pg_catalog.to_regnamespace(%s) IS NOT NULL,"
        " EXISTS (SELECT 1 FROM pg_catalog.pg_replication_slots WHERE slot_name = %s"
        "         AND database = pg_catalog.current_database()),"
        " EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = %s),"
        " ARRAY(SELECT roname FROM pg_catalog.pg_replication_origin WHERE roname = ANY(%s))",
        [PGMESH_SCHEMA, config.slot_name, config.publication_name,
         [config.origin_name(n) for n in config.node_names if n != node]],
    )
    row = await cur.fetchone()
    assert row is not None
    wanted = [config.origin_name(n) for n in config.node_names if n != node]
    found = {
        f"schema {PGMESH_SCHEMA}": row[0], f"slot {config.slot_name}": row[1],
        f"publication {config.publication_name}": row[2],
        **{f"replication origin {o}": o in row[3] for o in wanted},
    }
    for what, present in found.items():
        if not present:
            checks.append(Check(node, "object", False, f"{what} is missing", hint="run `pgmesh init` as a"
                                " superuser, or the script of `pgmesh init --print-sql`, on this node"))
    if not row[0]:
        return checks
    for privilege in ("USAGE", "CREATE"):  # CREATE: the appliers' decision functions (router.apply.decide)
        query = "SELECT pg_catalog.has_schema_privilege(%s, %s, %s)"
        row = await (await conn.execute(query, [role, PGMESH_SCHEMA, privilege])).fetchone()
        if not (row and row[0]):
            fix = f"GRANT {privilege} ON SCHEMA {PGMESH_SCHEMA} TO {who}"
            checks.append(_missing(node, f"schema {PGMESH_SCHEMA}", privilege, fix))
    params = {"role": role, "schema": PGMESH_SCHEMA, "table_privs": list(PGMESH_TABLE_PRIVILEGES)}
    for kind, name, privilege, ok in await (await conn.execute(_PGMESH_OBJECTS_SQL, params)).fetchall():
        if not ok:
            target = name if kind == "function" else f"{PGMESH_SCHEMA}.{name}"
            fix = f"GRANT {privilege} ON {kind.upper()} {target} TO {who}"
            checks.append(_missing(node, f"{kind} {target}", privilege, fix))
    return checks


async def _table_checks(conn: Conn, node: str, role: str, tables: Sequence[TableName]) -> list[Check]:
    checks: list[Check] = []
    query = ("SELECT t.s, t.n, p.priv FROM unnest(%s::text[], %s::text[]) t(s, n), unnest(%s::text[]) p(priv)"
             " WHERE NOT pg_catalog.has_table_privilege(%s, pg_catalog.format('%%I.%%I', t.s, t.n), p.priv)"
             " ORDER BY 1, 2, 3")
    params = [[s for s, _ in tables], [t for _, t in tables], list(TABLE_PRIVILEGES), role]
    lacking: dict[TableName, list[str]] = {}
    for schema, table, privilege in await (await conn.execute(query, params)).fetchall():
        lacking.setdefault((schema, table), []).append(privilege)
    for table, privileges in lacking.items():
        name = sql.Identifier(*table).as_string(None)
        fix = f"GRANT {', '.join(privileges)} ON TABLE {name} TO {sql.Identifier(role).as_string(None)}"
        checks.append(_missing(node, f"table {table[0]}.{table[1]}", ", ".join(privileges), fix,
                               relation=f"{table[0]}.{table[1]}"))
    return checks


async def _owner_checks(conn: Conn, node: str, role: str, tables: Sequence[TableName]) -> list[Check]:
    """Whether the role may act as each owner of the replicated tables: DDL those owners make elsewhere is
    replayed here as them (a warning: without it such DDL pauses the link, naming the GRANT)."""
    params = [[s for s, _ in tables], [t for _, t in tables]]
    owners = [str(r[0]) for r in await (await conn.execute(OWNERS_SQL, params)).fetchall()]
    option = " WITH SET TRUE" if conn.info.server_version >= SET_OPTION_SINCE else ""
    privilege = "SET" if conn.info.server_version >= SET_OPTION_SINCE else "MEMBER"
    checks: list[Check] = []
    who = sql.Identifier(role).as_string(None)
    for owner in owners:
        if owner == role:
            continue
        row = await (await conn.execute("SELECT pg_catalog.pg_has_role(%s, %s, %s)",
                                        [role, owner, privilege])).fetchone()
        if not (row and row[0]):
            fix = f"GRANT {sql.Identifier(owner).as_string(None)} TO {who}{option}"
            detail = (f"role {owner} (owns replicated tables): {role} cannot SET ROLE to it, so DDL that"
                      f" {owner} runs on another node pauses the link into this one")
            checks.append(Check(node, "privilege", True, detail, None, fix, warn=True))
    return checks


async def _check_node(config: Config, node: NodeConfig) -> tuple[list[Check], int]:
    try:
        conn = await connect(node)
    except PgmeshError as exc:
        return [Check(node.name, "connect", False, exc.message, hint=exc.hint)], 0
    except (psycopg.Error, OSError) as exc:
        hint = f"check the dsn of node {node.name}, its password and the server's pg_hba.conf"
        return [Check(node.name, "connect", False, describe(exc), hint=hint)], 0
    try:
        async with conn:
            role = str((await (await conn.execute("SELECT current_user")).fetchone() or ("",))[0])
            tables = await replicated_tables(conn, config)
            checks = await _role_checks(conn, node.name, role)
            if checks[0].detail.endswith("every privilege"):
                return checks + await _object_checks(conn, node.name, role, config), len(tables)
            checks += await _object_checks(conn, node.name, role, config)
            checks += await _table_checks(conn, node.name, role, tables)
            checks += await _owner_checks(conn, node.name, role, tables)
    except psycopg.Error as exc:
        return [Check(node.name, "privilege", False, f"reading the catalog failed: {describe(exc)}")], 0
    if all(c.ok for c in checks):
        checks.append(Check(node.name, "privilege", True, f"{role} holds every privilege pgmesh run needs"
                            f" on the {len(tables)} replicated tables of this node and pgmesh's objects"))
    return checks, len(tables)


async def check_run_role(config: Config) -> InitReport:
    """`pgmesh init --check`: on every node, as the config's role, every object of pgmesh and every
    privilege the router needs there; one failed check per missing thing, naming node and privilege. The
    report's count is of the nodes' replicated tables, each node's own count on its line."""
    results = await asyncio.gather(*(_check_node(config, node) for node in config.nodes))
    counts = sorted({n for _, n in results})
    counted = f"{counts[0]} replicated tables" if len(counts) == 1 else (
        "replicated tables per node: " + ", ".join(f"{node.name} {n}" for node, (_, n) in
                                                   zip(config.nodes, results, strict=True)))
    return InitReport([c for checks, _ in results for c in checks], [], config.cluster.name, counted=counted)
