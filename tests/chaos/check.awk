# Invariant checker for tests/chaos/chaos.sh (POSIX awk). Files, in order:
#   enqueued   "<plain|marquee> <jid> [marquee]"   jobs Redis accepted
#   uncertain  same format: pushes whose reply was lost (they may or may not have landed)
#   skipped    "<jid>" of Marquee jobs a worker skipped because a live holder had the lock, or
#              aborted because its lock was lost (both by design: the next tick reconciles)
#   remaining  "<jid>" of jobs still in Redis when the drain gave up (not lost, not run yet)
#   ledger     "P <jid>" per finished plain job;
#              "S|E|D <marquee> <fence> <start_us> <end_us> <worker> <jid> <phase>" per phase:
#              S at its start (with the planned end), E at its own end, D from a watcher once
#              the phase's process is gone (a KILLed phase has no E line; its end is D's).
#              A phase with neither (its end never seen) fails the run: an overlap measured
#              against its planned end could be a late kill or a real second holder.
# Overlap: two phase executions of one Marquee by different acquisitions overlapping in time.
# An acquisition is its fence and jid (a phase's worker pid is not: a phase started while its
# worker was dying sees pid 1 as its guardian's parent).
# Fences: by start time, a Marquee's fence never goes down, and one fence is one holder.
# Lost: a job Redis accepted that never ran (plain: no P line; Marquee: no phase started, not
# skipped beside a live holder). Pass -v left_procs=N -v left_redis=N.
FILENAME == ARGV[1] { kind[$2] = $1; next }
FILENAME == ARGV[2] { uncertain[$2] = 1; next }
FILENAME == ARGV[3] { skipped[$1] = 1; next }
FILENAME == ARGV[4] { remaining[$1] = 1; next }
$1 == "P" { runs[$2]++; plain_runs++; next }
$1 == "S" { n++; sm[n] = $2; sf[n] = $3; ss[n] = $4; se[n] = $5; sw[n] = $6; sj[n] = $7; sp[n] = $8
            started[$7] = 1; next }
$1 == "E" { ended[$2 SUBSEP $3 SUBSEP $4 SUBSEP $8] = $5; phases_done++; next }
$1 == "D" { gone[$2 SUBSEP $3 SUBSEP $4 SUBSEP $8] = $5; next }
END {
  tmp = ENVIRON["TMPDIR"]; if (tmp == "") tmp = "/tmp"
  srand(); f = tmp "/chaos_check." int(rand() * 1e9)
  for (i = 1; i <= n; i++) {
    k = sm[i] SUBSEP sf[i] SUBSEP ss[i] SUBSEP sp[i]
    seen = 1
    if (k in ended) e = ended[k]
    else if (k in gone) { e = gone[k]; killed++ }
    else {
      e = se[i]; unseen++; seen = 0
      if (unseen <= 5) printf "UNSEEN end of marquee %s phase %s (fence %s, jid %s): its planned end is used\n", sm[i], sp[i], sf[i], sj[i]
    }
    print sm[i], ss[i], e, sf[i], sw[i], sj[i], seen > f
    if (sp[i] == "sync") { cycles[sj[i] SUBSEP sf[i]] = 1; acq[sj[i]]++ }
  }
  close(f)
  overlaps = 0; fences_bad = 0; prev_m = ""
  cmd = "sort -k1,1n -k2,2n " f
  while ((cmd | getline line) > 0) {
    split(line, x, " ")
    m = x[1]; s = x[2] + 0; e = x[3] + 0; fence = x[4] + 0; holder = x[4] " " x[6]
    if (m != prev_m) { prev_m = m; max_end = -1; max_holder = ""; max_seen = 1; last_fence = -1; last_holder = "" }
    else {
      if (s < max_end && holder != max_holder) {
        overlaps++
        if (!max_seen) overlaps_unseen++
        if (overlaps <= 5) printf "OVERLAP marquee %s: %s started %d us before %s ended%s\n", m, holder, max_end - s, max_holder, (max_seen ? "" : " (its planned end: the real one was never seen)")
      }
      if (fence < last_fence || (fence == last_fence && holder != last_holder)) {
        fences_bad++
        if (fences_bad <= 5) printf "FENCE marquee %s: %s after %s\n", m, holder, last_holder
      }
    }
    if (e > max_end) { max_end = e; max_holder = holder; max_seen = x[7] + 0 }
    last_fence = fence; last_holder = holder
  }
  close(cmd); system("rm -f " f)
  lost = 0; jobs = 0; dup_plain = 0; dup_marquee = 0; unc_ran = 0
  for (j in kind) {
    jobs++
    if (kind[j] == "plain") {
      if (j in remaining) still++
      else if (!(j in runs)) { lost++; if (lost <= 5) print "LOST plain job " j }
      else if (runs[j] > 1) dup_plain++
    } else {
      if (j in remaining) still++
      else if (!(j in started) && !(j in skipped)) { lost++; if (lost <= 5) print "LOST marquee job " j }
      if (acq[j] > 1) dup_marquee++
    }
  }
  nunc = 0; for (j in uncertain) { nunc++; if ((j in runs) || (j in started)) unc_ran++ }
  ncycles = 0; for (c in cycles) ncycles++
  nskipped = 0; for (j in skipped) nskipped++
  printf "jobs enqueued: %d (+%d uncertain pushes, %d of them ran)\n", jobs, nunc, unc_ran
  printf "jobs run: %d plain runs, %d Marquee cycles started (%d phase executions, %d finished), %d skipped beside a live holder\n", plain_runs, ncycles, n, phases_done, nskipped
  printf "phases killed before their end: %d (end from the watcher), with no end seen: %d (must be 0)\n", killed + 0, unseen + 0
  printf "duplicates: %d plain jobs ran more than once, %d Marquee jobs acquired more than once\n", dup_plain, dup_marquee
  printf "overlapping holders of one Marquee: %d (must be 0), %d of them against an end never seen\n", overlaps, overlaps_unseen + 0
  printf "fences not increasing: %d (must be 0)\n", fences_bad
  printf "jobs lost: %d (must be 0)\n", lost
  printf "jobs still in Redis when the drain gave up: %d (must be 0)\n", still + 0
  printf "processes left behind: %d (must be 0)\n", left_procs
  ok = (overlaps == 0 && unseen == 0 && fences_bad == 0 && lost == 0 && left_procs == 0 && left_redis == 0)
  print (ok ? "chaos: PASS" : "chaos: FAIL")
  exit(ok ? 0 : 1)
}
