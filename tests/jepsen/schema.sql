-- The jepsen bed's own tables: the guarded rows and the history of every write attempt.
CREATE TABLE jepsen_marquees (
  id text PRIMARY KEY, fence bigint NOT NULL DEFAULT 0, version bigint NOT NULL DEFAULT 0,
  holder text);
CREATE TABLE jepsen_history (
  id bigserial PRIMARY KEY, marquee text NOT NULL, phase text NOT NULL, fence bigint NOT NULL,
  host text NOT NULL, jid text NOT NULL, pid int NOT NULL,
  started_us bigint NOT NULL, ended_us bigint NOT NULL,
  accepted boolean NOT NULL, version bigint);
