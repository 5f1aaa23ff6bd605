-- Messages of one queue not yet done (waiting, delayed or held): what join() waits on.
SELECT count(*) AS pending FROM {schema}.queue WHERE queue_name = %(queue_name)s
