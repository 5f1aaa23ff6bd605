-- The id of the caller's open transaction, taken by the in-memory test broker when a send joins
-- it: the send is delivered once that transaction committed and dropped if it rolled back.
SELECT pg_current_xact_id()::text AS xid
