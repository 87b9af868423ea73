-- The demo's stand-in for the Rails app's marquees table: each reconcile cycle writes the
-- Marquee's observed state with its fence, and a write carrying an older fence is refused.
CREATE TABLE IF NOT EXISTS marquees (
    id                   bigint PRIMARY KEY,
    observed_playgrounds text,
    observed_at          timestamptz,
    fence                bigint NOT NULL DEFAULT 0
);
INSERT INTO marquees (id) VALUES (1), (2), (3) ON CONFLICT (id) DO NOTHING;
