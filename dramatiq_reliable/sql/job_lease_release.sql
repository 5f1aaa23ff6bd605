-- The job ended: its lease goes (only the take that holds it can release it).
DELETE FROM {schema}.job_leases WHERE message_id = %(message_id)s AND token = %(token)s
