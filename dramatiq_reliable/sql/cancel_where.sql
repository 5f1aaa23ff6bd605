-- Cancel: what Postgres knows of a message that could not be deleted where it waited.
-- Each count is one look-up on an index by message id.
SELECT
    (SELECT count(*) FROM {schema}.processed_jobs WHERE message_id = %(message_id)s) AS done,
    (SELECT count(*) FROM {schema}.dead_letters WHERE message_id = %(message_id)s AND state = 'dead') AS dead,
    (SELECT count(*) FROM {schema}.queue WHERE message_id = %(message_id)s AND right(queue_name, 3) = '.XQ')
        AS dead_in_queue,
    (SELECT count(*) FROM {schema}.outbox WHERE message_id = %(message_id)s) AS in_outbox,
    (SELECT count(*) FROM {schema}.queue WHERE message_id = %(message_id)s) AS in_queue,
    (SELECT count(*) FROM {schema}.job_leases WHERE message_id = %(message_id)s) AS leased,
    (SELECT count(*) FROM {schema}.dead_letters WHERE message_id = %(message_id)s) AS handled_dead_letters
