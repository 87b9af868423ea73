# frozen_string_literal: true

# A "Playguard" tab in the Sidekiq Web UI (Sidekiq 6.4's extension API): the token locks
# playguard workers hold (holder, phase, lease left, fence) and the recent cycles with their
# outcomes. Require it next to sidekiq/web:
#
#   require "sidekiq/web"
#   require "playguard/web"   # registers the tab
#
# Reads only, with Sidekiq's own Redis connection. Redis keys: `processes` and the fields of
# `playguard:fetchers` (the identities), `playguard:locks:<identity>` (the holder record of
# each lock: field = lock key, value = {"token","jid","fence","label","class","acquired_at",
# "ttl_ms"}), `<identity>` (field `info`: the hostname), `<identity>:work` (the running phase,
# as of the last heartbeat) and each recorded lock key (GET: still the recorded token?; PTTL:
# lease left). Table (PostgreSQL, optional): `playguard_cycles`, the cycle ledger, when
# `PlayguardWeb.database_url` (default ENV["DATABASE_URL"]) is set and the pg gem loads;
# otherwise only the cycles running now are shown, from Redis, with a note saying so.
require "json"
require "sidekiq"
require "sidekiq/web"

module PlayguardWeb
  VIEW = File.expand_path("views/playguard.erb", __dir__)

  class << self
    # The ledger's PostgreSQL URL (a String, or a Proc returning one); nil: Redis only.
    attr_writer :database_url
    # How many recent cycles the tab lists (default 25).
    attr_writer :cycles_limit
    # The page reloads itself every this many seconds (default 5; nil or 0: never). Sidekiq's
    # Live Poll button works here too where its application.js is served.
    attr_writer :refresh_secs

    def database_url
      url = defined?(@database_url) ? @database_url : ENV["DATABASE_URL"]
      url = url.call if url.respond_to?(:call)
      url.nil? || url.to_s.empty? ? nil : url.to_s
    end

    def cycles_limit
      @cycles_limit || 25
    end

    def refresh_secs
      defined?(@refresh_secs) ? @refresh_secs : 5
    end

    # A URL with its password hidden, for the notes on the page.
    def redact(url)
      url.to_s.gsub(%r{(//[^:/@]*):[^@/]*@}, '\1:***@').gsub(/(password=)[^&\s]*/i, '\1***')
    end

    def now_ms
      (Time.now.to_f * 1000).to_i
    end

    def parse(json)
      JSON.parse(json)
    rescue JSON::ParserError, TypeError
      nil
    end

    # Every recorded lock, sorted by key: a Hash per lock (state "held" when the key still
    # holds the recorded token, else "stale").
    def locks
      Sidekiq.redis do |c|
        ids = (c.smembers("processes") + c.hkeys("playguard:fetchers")).uniq.sort
        per = c.pipelined do |p|
          ids.each do |id|
            p.hgetall("playguard:locks:#{id}")
            p.hget(id, "info")
            p.hgetall("#{id}:work")
          end
        end
        recs = []
        ids.each_with_index do |id, i|
          records, info, work = per[i * 3, 3]
          next if records.nil? || records.empty?
          host = parse(info)&.dig("hostname") || id.split(":")[0..-3].join(":")
          phases = {}
          (work || {}).each_value do |w|
            entry = parse(w) or next
            jid = parse(entry["payload"])&.dig("jid") or next
            phases[jid] = entry["phase"]
          end
          records.each do |key, json|
            rec = parse(json) || {}
            recs << {key: key, identity: id, host: host, rec: rec, phase: phases[rec["jid"]]}
          end
        end
        state = recs.empty? ? [] : c.pipelined { |p| recs.each { |r| p.get(r[:key]); p.pttl(r[:key]) } }
        now = now_ms
        recs.each_with_index.map { |r, i|
          rec = r[:rec]
          held = !rec["token"].to_s.empty? && state[i * 2] == rec["token"]
          pttl = state[i * 2 + 1].to_i
          acquired = rec["acquired_at"]
          {
            key: r[:key], label: rec["label"], identity: r[:identity], host: r[:host],
            jid: rec["jid"], class: rec["class"], phase: r[:phase],
            acquired_ms: acquired, held_ms: acquired && [now - acquired.to_i, 0].max,
            left_ms: held && pttl >= 0 ? pttl : nil, ttl_ms: rec["ttl_ms"],
            fence: rec["fence"], fence_from: "redis", cycle_id: nil,
            state: held ? "held" : "stale"
          }
        }.sort_by { |l| [l[:key], l[:identity]] }
      end
    end

    # [locks, cycles, notes]: the fences of running cycles and the recent cycles from the
    # ledger when it can be read, else the held locks as running cycles.
    def snapshot
      locks = self.locks
      notes = []
      cycles = nil
      if (url = database_url)
        begin
          require "pg"
          conn = PG.connect(url, connect_timeout: 3)
          begin
            conn.exec("SET statement_timeout = 5000")
            ledger_fences(conn, locks)
            cycles = recent_cycles(conn, cycles_limit)
            # The ledger writes a cycle's phase when it ends; a running one is in its lock's.
            phases = locks.to_h { |l| [[l[:key], l[:jid]], l[:phase]] }
            cycles.each { |c| c[:phase] ||= phases[[c[:lock_key], c[:jid]]] if c[:outcome] == "running" }
          ensure
            conn.close
          end
        rescue LoadError
          notes << "The pg gem is not installed (Debian: ruby-pg), so the ledger cannot be read: only the cycles running now are listed, from Redis; fences are the Redis acquire script's."
        rescue PG::Error => e
          notes << "Could not read playguard_cycles at #{redact(url)} (#{e.message.strip}): only the cycles running now are listed, from Redis; fences are the Redis acquire script's."
        end
      else
        notes << "No database URL (DATABASE_URL or PlayguardWeb.database_url): Redis keeps no cycle history, so only the cycles running now are listed, from the held locks."
      end
      cycles ||= locks.select { |l| l[:state] == "held" }
        .sort_by { |l| -l[:acquired_ms].to_i }
        .first(cycles_limit)
        .map { |l|
          {id: nil, lock_key: l[:key], jid: l[:jid], fence: l[:fence], identity: l[:identity],
           started_ms: l[:acquired_ms], finished_ms: nil, outcome: "running", phase: l[:phase],
           error: nil, took_ms: l[:held_ms]}
        }
      [locks, cycles, notes]
    end

    # The fence the cycle uses: its running ledger row's (PostgreSQL's for fence = "database").
    def ledger_fences(conn, locks)
      return if locks.empty?
      keys = PG::TextEncoder::Array.new.encode(locks.map { |l| l[:key] })
      rows = conn.exec_params(
        "SELECT lock_key, jid, fence, id FROM playguard_cycles
          WHERE outcome = 'running' AND lock_key = ANY($1::text[]) ORDER BY id", [keys]
      )
      by = {}
      rows.each { |r| by[[r["lock_key"], r["jid"]]] = r }
      locks.each do |l|
        r = by[[l[:key], l[:jid]]] or next
        l[:fence] = Integer(r["fence"])
        l[:cycle_id] = Integer(r["id"])
        l[:fence_from] = "ledger"
      end
    end

    def recent_cycles(conn, limit)
      now = now_ms
      conn.exec_params(
        "SELECT id, lock_key, jid, fence, identity,
                (extract(epoch FROM started_at) * 1000)::bigint AS started_ms,
                (extract(epoch FROM finished_at) * 1000)::bigint AS finished_ms,
                outcome, phase, error
           FROM playguard_cycles ORDER BY started_at DESC, id DESC LIMIT $1", [limit]
      ).map do |r|
        started = Integer(r["started_ms"])
        finished = r["finished_ms"] && Integer(r["finished_ms"])
        took = if finished then finished - started
               elsif r["outcome"] == "running" then now - started
               end
        {id: Integer(r["id"]), lock_key: r["lock_key"], jid: r["jid"], fence: Integer(r["fence"]),
         identity: r["identity"], started_ms: started, finished_ms: finished,
         outcome: r["outcome"], phase: r["phase"], error: r["error"], took_ms: took}
      end
    end
  end

  # View helpers (mixed into Sidekiq's WebAction).
  module Helpers
    def pg_duration(ms)
      return "-" if ms.nil?
      ms = [ms.to_i, 0].max
      s = ms / 1000
      if ms < 1000 then "#{ms}ms"
      elsif ms < 60_000 then format("%.1fs", ms / 1000.0)
      elsif ms < 3_600_000 then format("%dm%02ds", s / 60, s % 60)
      elsif ms < 86_400_000 then format("%dh%02dm", s / 3600, s % 3600 / 60)
      else format("%dd%02dh", s / 86_400, s % 86_400 / 3600)
      end
    end

    def pg_time(ms)
      ms ? relative_time(Time.at(ms / 1000.0).utc) : "-"
    end

    OUTCOME_COLORS = {
      "running" => "#337ab7", "complete" => "#3c763d", "failed" => "#a94442",
      "lock_lost" => "#a94442", "interrupted" => "#8a6d3b", "uncertain" => "#777"
    }.freeze

    def pg_outcome(outcome)
      color = OUTCOME_COLORS.fetch(outcome, "#777")
      %(<span class="label pg-outcome" style="background:#{color};color:#fff;padding:2px 6px;border-radius:3px">#{h outcome}</span>)
    end

    # A bar for the lease left (a share of the lock's ttl), with the time written on it.
    def pg_lease_bar(left_ms, ttl_ms)
      return %(<span class="pg-stale">stale</span>) if left_ms.nil?
      pct = ttl_ms.to_i > 0 ? (100.0 * left_ms / ttl_ms.to_i).clamp(0, 100).round : 0
      color = pct > 50 ? "#5cb85c" : (pct > 20 ? "#f0ad4e" : "#d9534f")
      %(<div class="pg-lease" title="#{pct}% of #{pg_duration(ttl_ms)} left" style="position:relative;min-width:120px;height:18px;background:#eee;border-radius:3px;overflow:hidden">) +
        %(<div style="width:#{pct}%;height:100%;background:#{color}"></div>) +
        %(<span style="position:absolute;left:6px;top:0;line-height:18px;font-size:12px;color:#000">#{pg_duration(left_ms)}</span></div>)
    end
  end

  def self.registered(app)
    app.helpers(Helpers)
    app.get "/playguard" do
      @pg_locks, @pg_cycles, @pg_notes = PlayguardWeb.snapshot
      secs = PlayguardWeb.refresh_secs.to_i
      add_to_head { %(<meta http-equiv="refresh" content="#{secs}">) } if secs > 0
      erb File.read(PlayguardWeb::VIEW)
    end
  end
end

Sidekiq::Web.register(PlayguardWeb)
Sidekiq::Web.tabs["Playguard"] = "playguard"
