"""Global sequences: `ids` (node ids, snowflake ids, sequence-backed columns and their status;
PL/pgSQL in `sql/`) and `convert` (`pgmesh sequences convert`).
"""
