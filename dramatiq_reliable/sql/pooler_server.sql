-- The database and server port a connection reaches, whatever it dialled (a pooler's port or the server's).
SELECT current_database() AS database_name, inet_server_port() AS server_port
