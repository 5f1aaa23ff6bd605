-- Dead rows per table of our schema from the statistics collector (pg_stat_user_tables): the
-- ratio of dead to all rows estimates table bloat without the pgstattuple extension.  Index
-- size against table size shows an index that grew out of proportion (a bloated index keeps
-- its pages after the rows that filled them are gone).
SELECT s.relname AS table_name,
       s.n_live_tup AS live_rows,
       s.n_dead_tup AS dead_rows,
       s.last_autovacuum,
       s.last_vacuum,
       pg_table_size(s.relid) AS table_bytes,
       pg_indexes_size(s.relid) AS index_bytes
FROM pg_stat_user_tables AS s
WHERE s.schemaname = %(schema)s
ORDER BY s.relname
