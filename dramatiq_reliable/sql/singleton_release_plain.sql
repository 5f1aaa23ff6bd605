-- The common release, one autocommit statement: the lease this run holds, when nothing is buffered.
DELETE FROM {schema}.singleton_leases
 WHERE key = %(key)s AND token = %(token)s AND buffered_body IS NULL
RETURNING key
