-- Seal a batch; fires it at once if every child has finished (or it has none).
SELECT {schema}.batch_seal(%(batch_id)s, %(target)s, %(channel)s) AS status
