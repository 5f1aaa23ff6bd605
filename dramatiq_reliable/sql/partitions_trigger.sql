-- Published rows leave the outbox in the statement that marks them (see migration 16).  A
-- statement trigger with a transition table: one call per marking statement, not per row.
DROP TRIGGER IF EXISTS outbox_move_published ON {schema}.outbox;
CREATE TRIGGER outbox_move_published AFTER UPDATE ON {schema}.outbox
    REFERENCING NEW TABLE AS marked
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.outbox_move_published()
