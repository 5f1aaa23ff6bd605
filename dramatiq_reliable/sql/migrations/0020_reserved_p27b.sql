-- Placeholder: p25-order's 0020 is not merged yet; the integrator drops this file at merge.
SELECT 1;
