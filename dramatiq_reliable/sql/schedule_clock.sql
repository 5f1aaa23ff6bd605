-- The time that decides what is due: the database's, so scheduler hosts with skewed clocks agree.
SELECT clock_timestamp() AS now
