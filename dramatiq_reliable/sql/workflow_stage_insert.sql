-- One stage: its kind and how many steps it waits for.
INSERT INTO {schema}.workflow_stages (workflow_id, stage, is_group, pending)
VALUES (%(workflow_id)s, %(stage)s, %(is_group)s, %(pending)s)
