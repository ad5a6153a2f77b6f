"""PostgreSQL's 002_types.pl ported to a two-node pgmesh mesh with the router running (issue 17): arrays,
enums, composites (as keys too, nested, in arrays), ranges, hstore and a domain whose CHECK calls an SQL
function. The original's inserts, updates and deletes run on node a and b must hold its expected rows;
then writes on b reach a, and the same rows updated, deleted and inserted on both nodes while the links
are paused take the conflict path (router.apply.careful.transaction) with these types; both nodes end equal.

Differences from the original: tst_dom_constr has no key, so it gets REPLICA IDENTITY FULL (pgmesh
asks for a key or a full identity); the expected rows are read with `concat` (NULL shows as nothing,
as in psql's unaligned output).
"""

from __future__ import annotations

from typing import Any

import psycopg

from router.testing.mesh import converged, execute, fetch, running_router, wait_for
from tests.fix_mesh import MeshFactory
from tests.integration.ports.common import healthy

SCHEMA = """
CREATE EXTENSION hstore WITH SCHEMA public;
CREATE TABLE public.tst_one_array (a INTEGER PRIMARY KEY, b INTEGER[]);
CREATE TABLE public.tst_arrays (a INTEGER[] PRIMARY KEY, b TEXT[], c FLOAT[], d INTERVAL[]);
CREATE TYPE public.tst_enum_t AS ENUM ('a', 'b', 'c', 'd', 'e');
CREATE TABLE public.tst_one_enum (a INTEGER PRIMARY KEY, b public.tst_enum_t);
CREATE TABLE public.tst_enums (a public.tst_enum_t PRIMARY KEY, b public.tst_enum_t[]);
CREATE TYPE public.tst_comp_basic_t AS (a FLOAT, b TEXT, c INTEGER);
CREATE TYPE public.tst_comp_enum_t AS (a FLOAT, b public.tst_enum_t, c INTEGER);
CREATE TYPE public.tst_comp_enum_array_t AS (a FLOAT, b public.tst_enum_t[], c INTEGER);
CREATE TABLE public.tst_one_comp (a INTEGER PRIMARY KEY, b public.tst_comp_basic_t);
CREATE TABLE public.tst_comps (a public.tst_comp_basic_t PRIMARY KEY, b public.tst_comp_basic_t[]);
CREATE TABLE public.tst_comp_enum (a INTEGER PRIMARY KEY, b public.tst_comp_enum_t);
CREATE TABLE public.tst_comp_enum_array (a public.tst_comp_enum_t PRIMARY KEY, b public.tst_comp_enum_t[]);
CREATE TABLE public.tst_comp_one_enum_array (a INTEGER PRIMARY KEY, b public.tst_comp_enum_array_t);
CREATE TABLE public.tst_comp_enum_what (
  a public.tst_comp_enum_array_t PRIMARY KEY, b public.tst_comp_enum_array_t[]);
CREATE TYPE public.tst_comp_mix_t AS (
  a public.tst_comp_basic_t, b public.tst_comp_basic_t[], c public.tst_enum_t, d public.tst_enum_t[]);
CREATE TABLE public.tst_comp_mix_array (a public.tst_comp_mix_t PRIMARY KEY, b public.tst_comp_mix_t[]);
CREATE TABLE public.tst_range (a INTEGER PRIMARY KEY, b int4range);
CREATE TABLE public.tst_range_array (a INTEGER PRIMARY KEY, b TSTZRANGE, c int8range[]);
CREATE TABLE public.tst_hstore (a INTEGER PRIMARY KEY, b public.hstore);
SET check_function_bodies = off;
CREATE FUNCTION public.monot_incr(int) RETURNS bool LANGUAGE sql
  AS ' select $1 > max(a) from public.tst_dom_constr; ';
CREATE DOMAIN monot_int AS int CHECK (monot_incr(VALUE));
CREATE TABLE public.tst_dom_constr (a monot_int);
ALTER TABLE public.tst_dom_constr REPLICA IDENTITY FULL;
"""

# (table, columns) in the order the original reads them back
TABLES = [
    ("tst_one_array", "a, b"), ("tst_arrays", "a, b, c, d"), ("tst_one_enum", "a, b"), ("tst_enums", "a, b"),
    ("tst_one_comp", "a, b"), ("tst_comps", "a, b"), ("tst_comp_enum", "a, b"),
    ("tst_comp_enum_array", "a, b"), ("tst_comp_one_enum_array", "a, b"), ("tst_comp_enum_what", "a, b"),
    ("tst_comp_mix_array", "a, b"), ("tst_range", "a, b"), ("tst_range_array", "a, b, c"),
    ("tst_hstore", "a, b"),
]
ALL_TABLES = [t for t, _ in TABLES] + ["tst_dom_constr"]

INSERTS = r"""
INSERT INTO tst_one_array (a, b) VALUES
  (1, '{1, 2, 3}'), (2, '{2, 3, 1}'), (3, '{3, 2, 1}'), (4, '{4, 3, 2}'), (5, '{5, NULL, 3}');
INSERT INTO tst_arrays (a, b, c, d) VALUES
  ('{1, 2, 3}', '{"a", "b", "c"}', '{1.1, 2.2, 3.3}', '{"1 day", "2 days", "3 days"}'),
  ('{2, 3, 1}', '{"b", "c", "a"}', '{2.2, 3.3, 1.1}', '{"2 minutes", "3 minutes", "1 minute"}'),
  ('{3, 1, 2}', '{"c", "a", "b"}', '{3.3, 1.1, 2.2}', '{"3 years", "1 year", "2 years"}'),
  ('{4, 1, 2}', '{"d", "a", "b"}', '{4.4, 1.1, 2.2}', '{"4 years", "1 year", "2 years"}'),
  ('{5, NULL, NULL}', '{"e", NULL, "b"}', '{5.5, 1.1, NULL}', '{"5 years", NULL, NULL}');
INSERT INTO tst_one_enum (a, b) VALUES (1, 'a'), (2, 'b'), (3, 'c'), (4, 'd'), (5, NULL);
INSERT INTO tst_enums (a, b) VALUES ('a', '{b, c}'), ('b', '{c, a}'), ('c', '{b, a}'), ('d', '{c, b}'),
  ('e', '{d, NULL}');
INSERT INTO tst_one_comp (a, b) VALUES (1, ROW(1.0, 'a', 1)), (2, ROW(2.0, 'b', 2)), (3, ROW(3.0, 'c', 3)),
  (4, ROW(4.0, 'd', 4)), (5, ROW(NULL, NULL, 5));
INSERT INTO tst_comps (a, b) VALUES
  (ROW(1.0, 'a', 1), ARRAY[ROW(1, 'a', 1)::tst_comp_basic_t]),
  (ROW(2.0, 'b', 2), ARRAY[ROW(2, 'b', 2)::tst_comp_basic_t]),
  (ROW(3.0, 'c', 3), ARRAY[ROW(3, 'c', 3)::tst_comp_basic_t]),
  (ROW(4.0, 'd', 4), ARRAY[ROW(4, 'd', 3)::tst_comp_basic_t]),
  (ROW(5.0, 'e', NULL), ARRAY[NULL, ROW(5, NULL, 5)::tst_comp_basic_t]);
INSERT INTO tst_comp_enum (a, b) VALUES (1, ROW(1.0, 'a', 1)), (2, ROW(2.0, 'b', 2)), (3, ROW(3.0, 'c', 3)),
  (4, ROW(4.0, 'd', 4)), (5, ROW(NULL, 'e', NULL));
INSERT INTO tst_comp_enum_array (a, b) VALUES
  (ROW(1.0, 'a', 1), ARRAY[ROW(1, 'a', 1)::tst_comp_enum_t]),
  (ROW(2.0, 'b', 2), ARRAY[ROW(2, 'b', 2)::tst_comp_enum_t]),
  (ROW(3.0, 'c', 3), ARRAY[ROW(3, 'c', 3)::tst_comp_enum_t]),
  (ROW(4.0, 'd', 3), ARRAY[ROW(3, 'd', 3)::tst_comp_enum_t]),
  (ROW(5.0, 'e', 3), ARRAY[ROW(3, 'e', 3)::tst_comp_enum_t, NULL]);
INSERT INTO tst_comp_one_enum_array (a, b) VALUES
  (1, ROW(1.0, '{a, b, c}', 1)), (2, ROW(2.0, '{a, b, c}', 2)), (3, ROW(3.0, '{a, b, c}', 3)),
  (4, ROW(4.0, '{c, b, d}', 4)), (5, ROW(5.0, '{NULL, e, NULL}', 5));
INSERT INTO tst_comp_enum_what (a, b) VALUES
  (ROW(1.0, '{a, b, c}', 1), ARRAY[ROW(1, '{a, b, c}', 1)::tst_comp_enum_array_t]),
  (ROW(2.0, '{b, c, a}', 2), ARRAY[ROW(2, '{b, c, a}', 1)::tst_comp_enum_array_t]),
  (ROW(3.0, '{c, a, b}', 1), ARRAY[ROW(3, '{c, a, b}', 1)::tst_comp_enum_array_t]),
  (ROW(4.0, '{c, b, d}', 4), ARRAY[ROW(4, '{c, b, d}', 4)::tst_comp_enum_array_t]),
  (ROW(5.0, '{c, NULL, b}', NULL), ARRAY[ROW(5, '{c, e, b}', 1)::tst_comp_enum_array_t]);
INSERT INTO tst_comp_mix_array (a, b) VALUES
  (ROW(ROW(1, 'a', 1), ARRAY[ROW(1, 'a', 1)::tst_comp_basic_t, ROW(2, 'b', 2)::tst_comp_basic_t], 'a',
       '{a,b,NULL,c}'),
   ARRAY[ROW(ROW(1, 'a', 1),
             ARRAY[ROW(1, 'a', 1)::tst_comp_basic_t, ROW(2, 'b', 2)::tst_comp_basic_t, NULL],
             'a', '{a,b,c}')::tst_comp_mix_t]);
INSERT INTO tst_range (a, b) VALUES (1, '[1, 10]'), (2, '[2, 20]'), (3, '[3, 30]'), (4, '[4, 40]'),
  (5, '[5, 50]');
INSERT INTO tst_range_array (a, b, c) VALUES
  (1, tstzrange('Mon Aug 04 00:00:00 2014 CEST'::timestamptz, 'infinity'), '{"[1,2]", "[10,20]"}'),
  (2, tstzrange('Sat Aug 02 00:00:00 2014 CEST'::timestamptz, 'Mon Aug 04 00:00:00 2014 CEST'::timestamptz),
   '{"[2,3]", "[20,30]"}'),
  (3, tstzrange('Fri Aug 01 00:00:00 2014 CEST'::timestamptz, 'Mon Aug 04 00:00:00 2014 CEST'::timestamptz),
   '{"[3,4]"}'),
  (4, tstzrange('Thu Jul 31 00:00:00 2014 CEST'::timestamptz, 'Mon Aug 04 00:00:00 2014 CEST'::timestamptz),
   '{"[4,5]", NULL, "[40,50]"}'),
  (5, NULL, NULL);
INSERT INTO tst_hstore (a, b) VALUES (1, '"a"=>"1"'), (2, '"zzz"=>"foo"'), (3, '"123"=>"321"'),
  (4, '"yellow horse"=>"moaned"');
INSERT INTO tst_dom_constr VALUES (10);
"""

UPDATES = r"""
UPDATE tst_one_array SET b = '{4, 5, 6}' WHERE a = 1;
UPDATE tst_one_array SET b = '{4, 5, 6, 1}' WHERE a > 3;
UPDATE tst_arrays SET b = '{"1a", "2b", "3c"}', c = '{1.0, 2.0, 3.0}',
  d = '{"1 day 1 second", "2 days 2 seconds", "3 days 3 second"}' WHERE a = '{1, 2, 3}';
UPDATE tst_arrays SET b = '{"c", "d", "e"}', c = '{3.0, 4.0, 5.0}',
  d = '{"3 day 1 second", "4 days 2 seconds", "5 days 3 second"}' WHERE a[1] > 3;
UPDATE tst_one_enum SET b = 'c' WHERE a = 1;
UPDATE tst_one_enum SET b = NULL WHERE a > 3;
UPDATE tst_enums SET b = '{e, NULL}' WHERE a = 'a';
UPDATE tst_enums SET b = '{e, d}' WHERE a > 'c';
UPDATE tst_one_comp SET b = ROW(1.0, 'A', 1) WHERE a = 1;
UPDATE tst_one_comp SET b = ROW(NULL, 'x', -1) WHERE a > 3;
UPDATE tst_comps SET b = ARRAY[ROW(9, 'x', -1)::tst_comp_basic_t] WHERE (a).a = 1.0;
UPDATE tst_comps SET b = ARRAY[NULL, ROW(9, 'x', NULL)::tst_comp_basic_t] WHERE (a).a > 3.9;
UPDATE tst_comp_enum SET b = ROW(1.0, NULL, NULL) WHERE a = 1;
UPDATE tst_comp_enum SET b = ROW(4.0, 'd', 44) WHERE a > 3;
UPDATE tst_comp_enum_array SET b = ARRAY[NULL, ROW(3, 'd', 3)::tst_comp_enum_t]
  WHERE a = ROW(1.0, 'a', 1)::tst_comp_enum_t;
UPDATE tst_comp_enum_array SET b = ARRAY[ROW(1, 'a', 1)::tst_comp_enum_t, ROW(2, 'b', 2)::tst_comp_enum_t]
  WHERE (a).a > 3;
UPDATE tst_comp_one_enum_array SET b = ROW(1.0, '{a, e, c}', NULL) WHERE a = 1;
UPDATE tst_comp_one_enum_array SET b = ROW(4.0, '{c, b, d}', 4) WHERE a > 3;
UPDATE tst_comp_enum_what SET b = ARRAY[NULL, ROW(1, '{a, b, c}', 1)::tst_comp_enum_array_t,
  ROW(NULL, '{a, e, c}', 2)::tst_comp_enum_array_t] WHERE (a).a = 1;
UPDATE tst_comp_enum_what SET b = ARRAY[ROW(5, '{a, b, c}', 5)::tst_comp_enum_array_t] WHERE (a).a > 3;
UPDATE tst_comp_mix_array SET b[2] = NULL WHERE ((a).a).a = 1;
UPDATE tst_range SET b = '[100, 1000]' WHERE a = 1;
UPDATE tst_range SET b = '(1, 90)' WHERE a > 3;
UPDATE tst_range_array SET c = '{"[100, 1000]"}' WHERE a = 1;
UPDATE tst_range_array SET b = tstzrange('Mon Aug 04 00:00:00 2014 CEST'::timestamptz, 'infinity'),
  c = '{NULL, "[11,9999999]"}' WHERE a > 3;
UPDATE tst_hstore SET b = '"updated"=>"value"' WHERE a < 3;
UPDATE tst_hstore SET b = '"also"=>"updated"' WHERE a = 3;
"""

DELETES = r"""
DELETE FROM tst_one_array WHERE a = 1;
DELETE FROM tst_one_array WHERE b = '{2, 3, 1}';
DELETE FROM tst_arrays WHERE a = '{1, 2, 3}';
DELETE FROM tst_arrays WHERE a[1] = 2;
DELETE FROM tst_one_enum WHERE a = 1;
DELETE FROM tst_one_enum WHERE b = 'b';
DELETE FROM tst_enums WHERE a = 'a';
DELETE FROM tst_enums WHERE b[1] = 'b';
DELETE FROM tst_one_comp WHERE a = 1;
DELETE FROM tst_one_comp WHERE (b).a = 2.0;
DELETE FROM tst_comps WHERE (a).b = 'a';
DELETE FROM tst_comps WHERE ROW(3, 'c', 3)::tst_comp_basic_t = ANY(b);
DELETE FROM tst_comp_enum WHERE a = 1;
DELETE FROM tst_comp_enum WHERE (b).a = 2.0;
DELETE FROM tst_comp_enum_array WHERE a = ROW(1.0, 'a', 1)::tst_comp_enum_t;
DELETE FROM tst_comp_enum_array WHERE ROW(3, 'c', 3)::tst_comp_enum_t = ANY(b);
DELETE FROM tst_comp_one_enum_array WHERE a = 1;
DELETE FROM tst_comp_one_enum_array WHERE 'a' = ANY((b).b);
DELETE FROM tst_comp_enum_what WHERE (a).a = 1;
DELETE FROM tst_comp_enum_what WHERE (b[1]).b = '{c, a, b}';
DELETE FROM tst_comp_mix_array WHERE ((a).a).a = 1;
DELETE FROM tst_range WHERE a = 1;
DELETE FROM tst_range WHERE '[10,20]' && b;
DELETE FROM tst_range_array WHERE a = 1;
DELETE FROM tst_range_array WHERE tstzrange('Mon Aug 04 00:00:00 2014 CEST'::timestamptz,
  'Mon Aug 05 00:00:00 2014 CEST'::timestamptz) && b;
DELETE FROM tst_hstore WHERE a = 1;
"""

AFTER_INSERTS = r"""
1|{1,2,3}
2|{2,3,1}
3|{3,2,1}
4|{4,3,2}
5|{5,NULL,3}
{1,2,3}|{a,b,c}|{1.1,2.2,3.3}|{"1 day","2 days","3 days"}
{2,3,1}|{b,c,a}|{2.2,3.3,1.1}|{00:02:00,00:03:00,00:01:00}
{3,1,2}|{c,a,b}|{3.3,1.1,2.2}|{"3 years","1 year","2 years"}
{4,1,2}|{d,a,b}|{4.4,1.1,2.2}|{"4 years","1 year","2 years"}
{5,NULL,NULL}|{e,NULL,b}|{5.5,1.1,NULL}|{"5 years",NULL,NULL}
1|a
2|b
3|c
4|d
5|
a|{b,c}
b|{c,a}
c|{b,a}
d|{c,b}
e|{d,NULL}
1|(1,a,1)
2|(2,b,2)
3|(3,c,3)
4|(4,d,4)
5|(,,5)
(1,a,1)|{"(1,a,1)"}
(2,b,2)|{"(2,b,2)"}
(3,c,3)|{"(3,c,3)"}
(4,d,4)|{"(4,d,3)"}
(5,e,)|{NULL,"(5,,5)"}
1|(1,a,1)
2|(2,b,2)
3|(3,c,3)
4|(4,d,4)
5|(,e,)
(1,a,1)|{"(1,a,1)"}
(2,b,2)|{"(2,b,2)"}
(3,c,3)|{"(3,c,3)"}
(4,d,3)|{"(3,d,3)"}
(5,e,3)|{"(3,e,3)",NULL}
1|(1,"{a,b,c}",1)
2|(2,"{a,b,c}",2)
3|(3,"{a,b,c}",3)
4|(4,"{c,b,d}",4)
5|(5,"{NULL,e,NULL}",5)
(1,"{a,b,c}",1)|{"(1,\"{a,b,c}\",1)"}
(2,"{b,c,a}",2)|{"(2,\"{b,c,a}\",1)"}
(3,"{c,a,b}",1)|{"(3,\"{c,a,b}\",1)"}
(4,"{c,b,d}",4)|{"(4,\"{c,b,d}\",4)"}
(5,"{c,NULL,b}",)|{"(5,\"{c,e,b}\",1)"}
("(1,a,1)","{""(1,a,1)"",""(2,b,2)""}",a,"{a,b,NULL,c}")|{"(\"(1,a,1)\",\"{\"\"(1,a,1)\"\",\"\"(2,b,2)\"\",NULL}\",a,\"{a,b,c}\")"}
1|[1,11)
2|[2,21)
3|[3,31)
4|[4,41)
5|[5,51)
1|["2014-08-04 00:00:00+02",infinity)|{"[1,3)","[10,21)"}
2|["2014-08-02 00:00:00+02","2014-08-04 00:00:00+02")|{"[2,4)","[20,31)"}
3|["2014-08-01 00:00:00+02","2014-08-04 00:00:00+02")|{"[3,5)"}
4|["2014-07-31 00:00:00+02","2014-08-04 00:00:00+02")|{"[4,6)",NULL,"[40,51)"}
5||
1|"a"=>"1"
2|"zzz"=>"foo"
3|"123"=>"321"
4|"yellow horse"=>"moaned"
"""

AFTER_UPDATES = r"""
1|{4,5,6}
2|{2,3,1}
3|{3,2,1}
4|{4,5,6,1}
5|{4,5,6,1}
{1,2,3}|{1a,2b,3c}|{1,2,3}|{"1 day 00:00:01","2 days 00:00:02","3 days 00:00:03"}
{2,3,1}|{b,c,a}|{2.2,3.3,1.1}|{00:02:00,00:03:00,00:01:00}
{3,1,2}|{c,a,b}|{3.3,1.1,2.2}|{"3 years","1 year","2 years"}
{4,1,2}|{c,d,e}|{3,4,5}|{"3 days 00:00:01","4 days 00:00:02","5 days 00:00:03"}
{5,NULL,NULL}|{c,d,e}|{3,4,5}|{"3 days 00:00:01","4 days 00:00:02","5 days 00:00:03"}
1|c
2|b
3|c
4|
5|
a|{e,NULL}
b|{c,a}
c|{b,a}
d|{e,d}
e|{e,d}
1|(1,A,1)
2|(2,b,2)
3|(3,c,3)
4|(,x,-1)
5|(,x,-1)
(1,a,1)|{"(9,x,-1)"}
(2,b,2)|{"(2,b,2)"}
(3,c,3)|{"(3,c,3)"}
(4,d,4)|{NULL,"(9,x,)"}
(5,e,)|{NULL,"(9,x,)"}
1|(1,,)
2|(2,b,2)
3|(3,c,3)
4|(4,d,44)
5|(4,d,44)
(1,a,1)|{NULL,"(3,d,3)"}
(2,b,2)|{"(2,b,2)"}
(3,c,3)|{"(3,c,3)"}
(4,d,3)|{"(1,a,1)","(2,b,2)"}
(5,e,3)|{"(1,a,1)","(2,b,2)"}
1|(1,"{a,e,c}",)
2|(2,"{a,b,c}",2)
3|(3,"{a,b,c}",3)
4|(4,"{c,b,d}",4)
5|(4,"{c,b,d}",4)
(1,"{a,b,c}",1)|{NULL,"(1,\"{a,b,c}\",1)","(,\"{a,e,c}\",2)"}
(2,"{b,c,a}",2)|{"(2,\"{b,c,a}\",1)"}
(3,"{c,a,b}",1)|{"(3,\"{c,a,b}\",1)"}
(4,"{c,b,d}",4)|{"(5,\"{a,b,c}\",5)"}
(5,"{c,NULL,b}",)|{"(5,\"{a,b,c}\",5)"}
("(1,a,1)","{""(1,a,1)"",""(2,b,2)""}",a,"{a,b,NULL,c}")|{"(\"(1,a,1)\",\"{\"\"(1,a,1)\"\",\"\"(2,b,2)\"\",NULL}\",a,\"{a,b,c}\")",NULL}
1|[100,1001)
2|[2,21)
3|[3,31)
4|[2,90)
5|[2,90)
1|["2014-08-04 00:00:00+02",infinity)|{"[100,1001)"}
2|["2014-08-02 00:00:00+02","2014-08-04 00:00:00+02")|{"[2,4)","[20,31)"}
3|["2014-08-01 00:00:00+02","2014-08-04 00:00:00+02")|{"[3,5)"}
4|["2014-08-04 00:00:00+02",infinity)|{NULL,"[11,10000000)"}
5|["2014-08-04 00:00:00+02",infinity)|{NULL,"[11,10000000)"}
1|"updated"=>"value"
2|"updated"=>"value"
3|"also"=>"updated"
4|"yellow horse"=>"moaned"
"""

AFTER_DELETES = r"""
3|{3,2,1}
4|{4,5,6,1}
5|{4,5,6,1}
{3,1,2}|{c,a,b}|{3.3,1.1,2.2}|{"3 years","1 year","2 years"}
{4,1,2}|{c,d,e}|{3,4,5}|{"3 days 00:00:01","4 days 00:00:02","5 days 00:00:03"}
{5,NULL,NULL}|{c,d,e}|{3,4,5}|{"3 days 00:00:01","4 days 00:00:02","5 days 00:00:03"}
3|c
4|
5|
b|{c,a}
d|{e,d}
e|{e,d}
3|(3,c,3)
4|(,x,-1)
5|(,x,-1)
(2,b,2)|{"(2,b,2)"}
(4,d,4)|{NULL,"(9,x,)"}
(5,e,)|{NULL,"(9,x,)"}
3|(3,c,3)
4|(4,d,44)
5|(4,d,44)
(2,b,2)|{"(2,b,2)"}
(4,d,3)|{"(1,a,1)","(2,b,2)"}
(5,e,3)|{"(1,a,1)","(2,b,2)"}
4|(4,"{c,b,d}",4)
5|(4,"{c,b,d}",4)
(2,"{b,c,a}",2)|{"(2,\"{b,c,a}\",1)"}
(4,"{c,b,d}",4)|{"(5,\"{a,b,c}\",5)"}
(5,"{c,NULL,b}",)|{"(5,\"{a,b,c}\",5)"}
2|["2014-08-02 00:00:00+02","2014-08-04 00:00:00+02")|{"[2,4)","[20,31)"}
3|["2014-08-01 00:00:00+02","2014-08-04 00:00:00+02")|{"[3,5)"}
2|"updated"=>"value"
3|"also"=>"updated"
4|"yellow horse"=>"moaned"
"""

# Writes on b after the original's: inserts, updates by (composite, enum, array) key, deletes.
FROM_B = """
INSERT INTO tst_comps VALUES (ROW(6.0, 'f', 6), ARRAY[ROW(6, 'f', NULL)::tst_comp_basic_t, NULL]);
UPDATE tst_comps SET b = ARRAY[ROW(2, 'B', 2)::tst_comp_basic_t] WHERE a = ROW(2.0, 'b', 2)::tst_comp_basic_t;
DELETE FROM tst_comps WHERE (a).a = 5.0;
INSERT INTO tst_comp_enum_array VALUES (ROW(6.0, 'a', 6), ARRAY[ROW(6, 'b', 6)::tst_comp_enum_t]);
UPDATE tst_comp_enum_array SET b = '{}' WHERE (a).a = 4.0;
INSERT INTO tst_comp_enum_what VALUES (ROW(6.0, '{e, NULL}', 6), NULL);
UPDATE tst_comp_enum_what SET b = ARRAY[ROW(2, '{a}', 2)::tst_comp_enum_array_t] WHERE (a).a = 2;
INSERT INTO tst_comp_mix_array VALUES
  (ROW(ROW(7, 'g', 7), ARRAY[NULL, ROW(7, NULL, 7)::tst_comp_basic_t], 'e', '{e}'),
   ARRAY[ROW(NULL, NULL, 'b', NULL)::tst_comp_mix_t]);
UPDATE tst_comp_mix_array SET b = b || ROW(ROW(8, 'h', 8), NULL, 'c', '{c,d}')::tst_comp_mix_t;
INSERT INTO tst_enums VALUES ('a', '{a, b, c, d, e}');
UPDATE tst_enums SET b = NULL WHERE a = 'b';
UPDATE tst_arrays SET d = '{"1 mon", NULL}' WHERE a = '{3, 1, 2}';
DELETE FROM tst_arrays WHERE a = '{4, 1, 2}';
INSERT INTO tst_range VALUES (6, 'empty'), (7, '(,)'), (8, '[-5,)');
UPDATE tst_range_array SET c = '{"[1,2)", "empty"}' WHERE a = 2;
INSERT INTO tst_hstore VALUES (5, 'k=>NULL, "q u"=>"x\\"y"');
UPDATE tst_one_comp SET b = ROW(-0.0, 'nul', NULL) WHERE a = 3;
INSERT INTO tst_dom_constr VALUES (12);
"""


async def _rows(dsn: str, table: str, columns: str) -> list[str]:
    """The table's rows as the original prints them (time zone +2, NULL as nothing, `|` between)."""
    cells = ", '|', ".join(c.strip() for c in columns.split(","))
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute("SET timezone = '+2'")
        cur = await conn.execute(f'SELECT concat({cells}) FROM "{table}" ORDER BY a')
        return [row[0] for row in await cur.fetchall()]


async def _all_rows(dsn: str) -> str:
    out: list[str] = []
    for table, columns in TABLES:
        out += await _rows(dsn, table, columns)
    return "\n".join(out)


async def _expect(node: Any, expected: str, router: Any, what: str) -> None:
    want = expected.strip("\n")

    async def check() -> bool:
        healthy(router)
        return await _all_rows(node.dsn()) == want

    try:
        await wait_for(check, what, 120)
    except AssertionError as exc:
        if "timed out" not in str(exc):
            raise  # a link stopped (healthy)
        got = (await _all_rows(node.dsn())).splitlines()
        missing = [line for line in want.splitlines() if line not in got]
        extra = [line for line in got if line not in want.splitlines()]
        raise AssertionError(f"{what}: missing {missing}, unexpected {extra}") from None


async def _conflicts(node: Any) -> int:
    (row,) = await fetch(node.dsn(), "SELECT count(*) FROM pgmesh.conflict_history")
    return int(row[0])


async def _equal(m: Any, router: Any) -> None:
    async def check() -> bool:
        healthy(router)
        return await converged(m.nodes, ALL_TABLES)

    await wait_for(check, "every table equal on both nodes", 120)
    assert await _all_rows(m.nodes[0].dsn()) == await _all_rows(m.nodes[1].dsn())


async def test_002_types(mesh: MeshFactory) -> None:
    m = await mesh(nodes=2, schema=SCHEMA)
    a, b = m.nodes
    async with running_router(m.config) as router:
        await execute(a.dsn(), INSERTS)
        await _expect(b, AFTER_INSERTS, router, "the inserts on b")
        await execute(a.dsn(), UPDATES)
        await _expect(b, AFTER_UPDATES, router, "the updates on b")
        await execute(a.dsn(), DELETES)
        await _expect(b, AFTER_DELETES, router, "the deletes on b")
        # a domain whose CHECK reads the table through an SQL function (needs a snapshot on apply)
        await execute(a.dsn(), "INSERT INTO tst_dom_constr VALUES (11)")
        await wait_for(lambda: _sum(b, 21), "sql-function constraint on domain", 60)

        # writes on b reach a
        await execute(b.dsn(), FROM_B)
        await _equal(m, router)
        await wait_for(lambda: _sum(a, 33), "tst_dom_constr's 12 on a", 60)
        # its rows updated and deleted (matched by the whole row: a value compared is not cast to the
        # domain, whose CHECK would refuse 10 and 12 now)
        await execute(a.dsn(), "UPDATE tst_dom_constr SET a = 13 WHERE a = 12")
        await wait_for(lambda: _sum(b, 34), "the update of tst_dom_constr on b", 60)
        await execute(b.dsn(), "DELETE FROM tst_dom_constr WHERE a = 10")
        await wait_for(lambda: _sum(a, 24), "the delete from tst_dom_constr on a", 60)
        before = (await _conflicts(a), await _conflicts(b))  # b's updates of a's rows count there

        # the same rows written on both nodes while the links are paused: the conflict path decides
        await router.pause(None)
        await execute(a.dsn(), CONFLICTS_A)
        await execute(b.dsn(), CONFLICTS_B)
        await router.resume(None)
        await _equal(m, router)
        assert await _conflicts(a) > before[0] and await _conflicts(b) > before[1]
        kinds = {r[0] for n in m.nodes for r in await fetch(
            n.dsn(), "SELECT DISTINCT conflict_type FROM pgmesh.conflict_history")}
        assert {"update_origin_differs", "insert_exists"} <= kinds, kinds
        healthy(router)


async def _sum(node: Any, total: int) -> bool:
    return await fetch(node.dsn(), "SELECT sum(a)::int FROM tst_dom_constr") == [(total,)]


# Updated on both nodes (rows keyed by composites, nested composites, enums, arrays), the same new
# composite key inserted on both, a row updated on one node and deleted on the other.
CONFLICTS_A = """
UPDATE tst_comps SET b = ARRAY[ROW(1, 'from a', 1)::tst_comp_basic_t] WHERE (a).a IN (2.0, 4.0);
UPDATE tst_comp_enum_array SET b = ARRAY[NULL, ROW(0, 'a', 0)::tst_comp_enum_t] WHERE (a).a > 1;
UPDATE tst_comp_enum_what SET b = NULL WHERE true;
UPDATE tst_comp_mix_array SET b = NULL WHERE ((a).a).a = 7;
UPDATE tst_enums SET b = '{a}' WHERE a IN ('b', 'd');
UPDATE tst_arrays SET b = '{from a}' WHERE a[1] IN (3, 5);
UPDATE tst_range_array SET b = '[2020-01-01,2020-02-01)' WHERE a = 2;
UPDATE tst_one_comp SET b = ROW(1.5, 'from a', 1) WHERE a = 4;
UPDATE tst_hstore SET b = b || 'who=>a' WHERE a = 2;
INSERT INTO tst_comps VALUES (ROW(8.0, 'h', 8), ARRAY[ROW(8, 'a', 8)::tst_comp_basic_t]);
INSERT INTO tst_comp_enum_what VALUES (ROW(8.0, '{a,a}', 8), NULL);
DELETE FROM tst_comp_enum WHERE a = 3;
UPDATE tst_comp_one_enum_array SET b = ROW(0, '{e}', 0) WHERE a = 5;
"""
CONFLICTS_B = """
UPDATE tst_comps SET b = ARRAY[ROW(1, 'from b', 1)::tst_comp_basic_t, NULL] WHERE (a).a IN (2.0, 4.0);
UPDATE tst_comp_enum_array SET b = ARRAY[ROW(0, 'b', 0)::tst_comp_enum_t] WHERE (a).a > 1;
UPDATE tst_comp_enum_what SET b = '{}' WHERE true;
UPDATE tst_comp_mix_array SET b = ARRAY[NULL]::tst_comp_mix_t[] WHERE ((a).a).a = 7;
UPDATE tst_enums SET b = '{b}' WHERE a IN ('b', 'd');
UPDATE tst_arrays SET b = '{from b}' WHERE a[1] IN (3, 5);
UPDATE tst_range_array SET b = '[2021-01-01,2021-02-01)' WHERE a = 2;
UPDATE tst_one_comp SET b = ROW(2.5, 'from b', 2) WHERE a = 4;
UPDATE tst_hstore SET b = b || 'who=>b' WHERE a = 2;
INSERT INTO tst_comps VALUES (ROW(8.0, 'h', 8), ARRAY[ROW(8, 'b', 8)::tst_comp_basic_t]);
INSERT INTO tst_comp_enum_what VALUES (ROW(8.0, '{a,a}', 8), '{}');
UPDATE tst_comp_enum SET b = ROW(3.5, 'e', 3) WHERE a = 3;
DELETE FROM tst_comp_one_enum_array WHERE a = 5;
"""
