-- The jepsen bed's own tables: the guarded rows and the history of every write attempt.
CREATE TABLE jepsen_marquees (
  id text PRIMARY KEY, fence bigint NOT NULL DEFAULT 0, version bigint NOT NULL DEFAULT 0,
  holder text);
CREATE TABLE jepsen_history (
  id bigserial PRIMARY KEY, marquee text NOT NULL, phase text NOT NULL, fence bigint NOT NULL,
  host text NOT NULL, jid text NOT NULL, pid int NOT NULL,
  started_us bigint NOT NULL, ended_us bigint NOT NULL,
  accepted boolean NOT NULL, version bigint);
-- Every attempt of a pushed plain job, and every run of a periodic probe.
CREATE TABLE jepsen_plain (
  id bigserial PRIMARY KEY, jid text NOT NULL, host text NOT NULL, ok boolean NOT NULL,
  at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE jepsen_ticks (
  id bigserial PRIMARY KEY, member text NOT NULL, created_s bigint NOT NULL, jid text NOT NULL,
  host text NOT NULL);
-- Loaded at the end: what the pusher pushed, and what Redis still holds.
CREATE TABLE jepsen_pushed (jid text PRIMARY KEY, confirmed boolean NOT NULL);
CREATE TABLE jepsen_in_redis (jid text PRIMARY KEY);
