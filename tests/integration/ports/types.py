"""Every type PostgreSQL ships, in tables for the type ports (issue 17, "all built-in types").

Owns: a sample value (two, and NULL) for each base type of pg_catalog, and the SQL that makes a table
holding a column of each, an array of each, a composite of them all (and an array of it), enums,
ranges and multiranges (built-in and user-defined), domains over arrays, composites and enums, and a
user-defined base type without binary I/O (no send or receive function: PostgreSQL's 014_binary's
`myvarchar`, made from internal functions, needs no C). `missing_samples` names the base types a server
has that no sample covers, so that a type added by a new release fails the test instead of being
skipped.
Must not: run a router or compare nodes (the tests do).
"""

from __future__ import annotations

from collections.abc import Iterable

# typname -> (type as declared, a value, another value), each value as text read by the type's input
SAMPLES: dict[str, tuple[str, str, str]] = {
    "bool": ("boolean", "true", "false"),
    "bytea": ("bytea", "\\x00ff275c0a09", "\\x"),
    "char": ('"char"', "x", "\\"),
    "name": ("name", "a name", "tab\there"),
    "int8": ("bigint", "-9223372036854775808", "9223372036854775807"),
    "int2": ("smallint", "-32768", "32767"),
    "int2vector": ("int2vector", "1 2 3", ""),
    "int4": ("integer", "2147483647", "-1"),
    "regproc": ("regproc", "now", "pg_catalog.textlen"),
    "text": ("text", "tab\there, quote ' backslash \\ newline\n and 日本", ""),
    "oid": ("oid", "4294967295", "0"),
    "tid": ("tid", "(42,7)", "(0,1)"),
    "xid": ("xid", "4000000000", "3"),
    "cid": ("cid", "77", "0"),
    "oidvector": ("oidvector", "1 2 4294967295", ""),
    "json": ("json", '{"b": [1, 2.50, null],  "a": "x\\u00e9"}', "[]"),
    "xml": ("xml", '<a b="1">t&amp;</a>', "text only"),
    "point": ("point", "(1.5,-2)", "(0,0)"),
    "lseg": ("lseg", "[(0,0),(1,1)]", "[(1,1),(0,0)]"),
    "path": ("path", "[(0,0),(1,1),(2,0)]", "((0,0),(1,1))"),
    "box": ("box", "(1,1),(0,0)", "(3,3),(2,2)"),
    "polygon": ("polygon", "((0,0),(1,1),(1,0))", "((0,0),(2,2),(2,0))"),
    "line": ("line", "{1,-1,0}", "{1,0,5}"),
    "cidr": ("cidr", "10.1.0.0/16", "2001:db8::/32"),
    "float4": ("real", "1.17549435e-38", "-Infinity"),
    "float8": ("double precision", "-1.7976931348623157e+308", "NaN"),
    "circle": ("circle", "<(1,2),3>", "<(0,0),1>"),
    "macaddr8": ("macaddr8", "08:00:2b:01:02:03:04:05", "00:00:00:00:00:00:00:00"),
    "money": ("money", "-12.34", "92233720368547758.07"),
    "macaddr": ("macaddr", "08:00:2b:01:02:03", "ff:ff:ff:ff:ff:ff"),
    "inet": ("inet", "2001:db8::1/64", "192.168.0.1"),
    "aclitem": ("aclitem", "postgres=arwdDxt/postgres", "=r/postgres"),  # no binary I/O
    "bpchar": ("character(6)", "pad", "padded"),
    "varchar": ("character varying(8)", "v", "varchar8"),
    "date": ("date", "2000-02-29", "-infinity"),
    "time": ("time without time zone", "23:59:59.999999", "00:00:00"),
    "timestamp": ("timestamp without time zone", "1999-12-31 23:59:59.5", "infinity"),
    "timestamptz": ("timestamp with time zone", "2014-08-04 00:00:00+02", "4713-01-01 00:00:00+00 BC"),
    "interval": ("interval", "1 year 2 mons -3 days 04:05:06.7", "-178000000 years"),
    "timetz": ("time with time zone", "12:00:00-05:30", "00:00:00+14"),
    "bit": ("bit(3)", "101", "000"),
    "varbit": ("bit varying", "1101", ""),
    "numeric": ("numeric", "-123456789012345678901234567890.000000001", "NaN"),
    "refcursor": ("refcursor", "cur", "another cursor"),
    "regprocedure": ("regprocedure", "now()", "lower(text)"),
    "regoper": ("regoper", "||/", "!!"),
    "regoperator": ("regoperator", "+(integer,integer)", "-(NONE,bigint)"),
    "regclass": ("regclass", "pg_class", "pg_catalog.pg_type"),
    "regtype": ("regtype", "integer", "character varying[]"),
    "uuid": ("uuid", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "00000000-0000-0000-0000-000000000000"),
    "txid_snapshot": ("txid_snapshot", "10:20:10,14,15", "1:1:"),
    "pg_lsn": ("pg_lsn", "16/B374D848", "0/0"),
    "tsvector": ("tsvector", "a fat:1A cat", ""),
    "tsquery": ("tsquery", "fat & (rat | !cat)", "'x y'"),
    "regconfig": ("regconfig", "english", "simple"),
    "regdictionary": ("regdictionary", "simple", "english_stem"),
    "jsonb": ("jsonb", '{"a": [1, {"b": null}], "c": 1.50}', '"s"'),
    "jsonpath": ("jsonpath", "$.a[*] ? (@ > 1)", "strict $"),
    "regnamespace": ("regnamespace", "public", "pg_catalog"),
    "regrole": ("regrole", "postgres", "pg_monitor"),
    "regcollation": ("regcollation", '"C"', '"POSIX"'),
    "pg_snapshot": ("pg_snapshot", "10:20:10,14,15", "1:1:"),
    "xid8": ("xid8", "18446744073709551615", "0"),
}

# Base types no table can hold a value of: their input functions refuse every value (planner and
# index internals).
NOT_STORABLE = frozenset({
    "pg_node_tree", "pg_ndistinct", "pg_dependencies", "pg_mcv_list", "pg_brin_bloom_summary",
    "pg_brin_minmax_multi_summary", "gtsvector",
})

# Every base type of pg_catalog that is not an array type (int2vector and oidvector are listed).
BASE_TYPES_SQL = """
SELECT t.typname FROM pg_catalog.pg_type t
WHERE t.typtype = 'b' AND t.typnamespace = 'pg_catalog'::regnamespace
  AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_type e WHERE e.typarray = t.oid)
ORDER BY t.oid
"""


def missing_samples(typnames: Iterable[str]) -> list[str]:
    return sorted(set(typnames) - set(SAMPLES) - NOT_STORABLE)


def lit(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


# User-made types: an enum, a range over float8 (and its multirange), domains, a base type without
# send/receive functions, and a composite of every built-in base type.
USER_TYPES = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'it''s "odd"');
CREATE TYPE floatrange AS RANGE (subtype = float8, subtype_diff = float8mi);
CREATE DOMAIN int_list AS int[] CHECK (cardinality(VALUE) < 10);
CREATE DOMAIN good_mood AS mood CHECK (VALUE <> 'sad');
CREATE TYPE myvarchar;
CREATE FUNCTION myvarcharin(cstring, oid, integer) RETURNS myvarchar
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharin';
CREATE FUNCTION myvarcharout(myvarchar) RETURNS cstring
  LANGUAGE internal IMMUTABLE PARALLEL SAFE STRICT AS 'varcharout';
CREATE TYPE myvarchar (input = myvarcharin, output = myvarcharout);
"""

# (column, type, value, other value) of the user-made types, ranges and multiranges
EXTRA_COLUMNS: list[tuple[str, str, str, str]] = [
    ("x_mood", "mood", lit("it's \"odd\""), lit("sad")),
    ("x_moods", "mood[]", lit('{happy,NULL,"it\'s \\"odd\\""}'), lit("{}")),
    ("x_good_mood", "good_mood", lit("ok"), lit("happy")),
    ("x_int4range", "int4range", lit("[1,10]"), lit("empty")),
    ("x_int8range", "int8range", lit("(,5)"), lit("(,)")),
    ("x_numrange", "numrange", lit("[1.5,2.25)"), lit("[-1e-20,)")),
    ("x_tsrange", "tsrange", lit('["2014-08-04 00:00",infinity)'), lit("empty")),
    ("x_tstzrange", "tstzrange", lit('["2014-08-04 00:00:00+02",)'), lit("(,)")),
    ("x_daterange", "daterange", lit("[2000-01-01,2000-02-29]"), lit("[-infinity,infinity)")),
    ("x_int4multirange", "int4multirange", lit("{[1,3),[5,8)}"), lit("{}")),
    ("x_int8multirange", "int8multirange", lit("{(,0),[10,)}"), lit("{[1,2)}")),
    ("x_nummultirange", "nummultirange", lit("{[1.5,2),[3,4.5]}"), lit("{}")),
    ("x_tsmultirange", "tsmultirange", lit('{["2000-01-01",infinity)}'), lit("{}")),
    ("x_tstzmultirange", "tstzmultirange", lit('{["2000-01-01 00:00+05",)}'), lit("{}")),
    ("x_datemultirange", "datemultirange", lit("{[2000-01-01,2000-01-03),[2000-02-01,)}"), lit("{}")),
    ("x_floatrange", "floatrange", lit("[-1.5,Infinity)"), lit("empty")),
    ("x_floatmultirange", "floatmultirange", lit("{[1,2),(3,4]}"), lit("{}")),
    ("x_ranges", "int8range[]", lit('{"[1,2)",NULL,empty}'), lit("{}")),
    ("x_multiranges", "int4multirange[]", lit('{"{[1,2)}","{}"}'), lit("{NULL}")),
    ("x_int_list", "int_list", lit("{1,NULL,3}"), lit("{}")),
    ("x_int_lists", "int_list[]", lit('{"{1}",NULL}'), lit("{}")),
    ("x_myvarchar", "myvarchar", lit("no send, no recv"), lit("")),
    ("x_myvarchars", "myvarchar[]", lit('{a,"b c",NULL}'), lit("{}")),
]


def scalar_columns(typnames: Iterable[str]) -> list[tuple[str, str, str, str]]:
    """(column, declared type, value SQL, other value SQL) of each built-in base type and its array."""
    out = []
    for typname in typnames:
        if typname not in SAMPLES:
            continue
        declared, one, two = SAMPLES[typname]
        out.append((f"c_{typname}", declared, f"{lit(one)}::{declared}", f"{lit(two)}::{declared}"))
        array = f"{declared}[]"
        out.append((
            f"a_{typname}", array,
            f"ARRAY[{lit(one)}::{declared}, NULL, {lit(two)}::{declared}]", f"ARRAY[]::{array}",
        ))
    return out


def schema_sql(typnames: list[str]) -> str:
    """The types and tables: `every_type` (id primary key), `every_type_full` (the same columns, no
    key, REPLICA IDENTITY FULL)."""
    scalars = [(c, d, one, two) for c, d, one, two in scalar_columns(typnames) if c.startswith("c_")]
    fields = ", ".join(f'"f_{c[2:]}" {d}' for c, d, _, _ in scalars)
    columns = [*scalar_columns(typnames), *EXTRA_COLUMNS, *composite_columns(typnames)]
    body = ", ".join(f'"{c}" {d}' for c, d, _, _ in columns)
    return (
        USER_TYPES
        + f"CREATE TYPE every_t AS ({fields});\n"
        + "CREATE DOMAIN every_d AS every_t CHECK ((VALUE).f_int4 <> 0);\n"
        + f'CREATE TABLE every_type ("id" integer PRIMARY KEY, {body});\n'
        + "CREATE TABLE every_type_full (LIKE every_type);\n"
        + "ALTER TABLE every_type_full REPLICA IDENTITY FULL;\n"
    )


def _row_of(typnames: list[str], which: int) -> str:
    scalars = [(c, one, two) for c, _, one, two in scalar_columns(typnames) if c.startswith("c_")]
    return "ROW(" + ", ".join(one if which == 1 else two for _, one, two in scalars) + ")::every_t"


def composite_columns(typnames: list[str]) -> list[tuple[str, str, str, str]]:
    one, two = _row_of(typnames, 1), _row_of(typnames, 2)
    return [
        ("x_every", "every_t", one, two),
        ("x_everys", "every_t[]", f"ARRAY[{one}, NULL, {two}]", "ARRAY[]::every_t[]"),
        ("x_every_d", "every_d", f"{one}::every_d", f"{two}::every_d"),
        ("x_every_ds", "every_d[]", f"ARRAY[{one}::every_d, NULL]", "'{}'"),
    ]


def all_columns(typnames: list[str]) -> list[tuple[str, str, str, str]]:
    return [*scalar_columns(typnames), *EXTRA_COLUMNS, *composite_columns(typnames)]


def insert_sql(table: str, typnames: list[str], row_id: int, which: int) -> str:
    """A row of `table`: the first values (which 1), the others (2), or NULL everywhere (0)."""
    columns = all_columns(typnames)
    names = ", ".join(f'"{c}"' for c, _, _, _ in columns)
    values = ", ".join("NULL" if which == 0 else (one if which == 1 else two) for _, _, one, two in columns)
    return f'INSERT INTO "{table}" ("id", {names}) VALUES ({row_id}, {values})'
