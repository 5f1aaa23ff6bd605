-- Which server process runs this statement: behind a transaction pooler it changes.
SELECT pg_backend_pid() AS backend_pid
