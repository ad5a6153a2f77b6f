"""What every layer needs to reach a node: `connect` (the one connect helper, the `Conn` type, the admin
session's setup and `one`, a query's first value), `dsn` (a DSN with libpq's meaning for asyncpg, and a
password kept in a file), `sqlfiles` (the `.sql` files shipped as package data, read as statements) and
`pgbin` (finding PostgreSQL's programs by major version).

Must not: import anything above `router.config` and `router.errors`, stream or apply changes.
"""
