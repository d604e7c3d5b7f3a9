//! The benchmark report: short interleaved measurements of every strategy × backend (ours
//! and the raw floor alternately, with Redis in the same rotation, so that the drift of a
//! shared machine cancels), 8-thread contention, optionally the scale runs, printed as the
//! Markdown of BENCHMARKS.md, with an SVG chart of handoffs/s.
//!
//! ```text
//! eval "$(bash scripts/services.sh)"
//! cargo run --release --all-features --example bench_report -- \
//!     --out BENCHMARKS.md --svg docs/handoffs.svg [--scale] [--quick]
//! ```

#[path = "../benches/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;
use support::kinds::kinds;
use support::{raw, scale, Db, Sharing, Stop};

struct Args {
    out: Option<String>,
    svg: Option<String>,
    scale: bool,
    quick: bool,
}

fn args() -> Args {
    let mut a = Args {
        out: None,
        svg: None,
        scale: false,
        quick: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--out" => a.out = it.next(),
            "--svg" => a.svg = it.next(),
            "--scale" => a.scale = true,
            "--quick" => a.quick = true,
            other => {
                panic!("unknown argument {other:?} (--out FILE, --svg FILE, --scale, --quick)")
            }
        }
    }
    a
}

/// A contention run: backend (by position), strategy, sharing.
type Run = (usize, &'static str, &'static str);

#[derive(Default, Clone)]
struct Row {
    statements: &'static str,
    ours: f64,
    raw: f64,
    redis: Option<f64>,
    /// PostgreSQL Row and Lease: the raw floor without `pg_notify` in the release.
    raw_silent: Option<f64>,
    /// Session strategies: the lock with no token at all (`Pair::bare`), cycles/s.
    bare: Option<f64>,
    bare_statements: &'static str,
    /// MariaDB Row and Lease, PostgreSQL Row: the hand-written statements with a fencing
    /// token (`Pair::bare_token`), cycles/s.
    bare_token: Option<f64>,
    bare_token_statements: &'static str,
    /// (handoffs/s, fairness) with 8 threads on one key, per sharing.
    shared: Option<(f64, f64)>,
    separate: Option<(f64, f64)>,
}

fn server_version(db: Db) -> String {
    use diesel::{Connection, QueryableByName, RunQueryDsl};
    #[derive(QueryableByName)]
    struct V {
        #[diesel(sql_type = diesel::sql_types::Text)]
        v: String,
    }
    let url = support::url(db).unwrap();
    let q = match db {
        Db::Sqlite => "SELECT 'SQLite ' || sqlite_version() AS v",
        Db::Mysql => "SELECT VERSION() AS v",
        Db::Postgres => "SELECT split_part(version(), ' on ', 1) AS v",
    };
    let v: Result<V, String> = match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => diesel::PgConnection::establish(&url)
            .map_err(|e| e.to_string())
            .and_then(|mut c| {
                diesel::sql_query(q)
                    .get_result(&mut c)
                    .map_err(|e| e.to_string())
            }),
        #[cfg(feature = "mysql")]
        Db::Mysql => diesel::MysqlConnection::establish(&url)
            .map_err(|e| e.to_string())
            .and_then(|mut c| {
                diesel::sql_query(q)
                    .get_result(&mut c)
                    .map_err(|e| e.to_string())
            }),
        #[cfg(feature = "sqlite")]
        Db::Sqlite => diesel::SqliteConnection::establish(":memory:")
            .map_err(|e| e.to_string())
            .and_then(|mut c| {
                diesel::sql_query(q)
                    .get_result(&mut c)
                    .map_err(|e| e.to_string())
            }),
        #[allow(unreachable_patterns)]
        _ => Err("not compiled in".into()),
    };
    v.map(|v| v.v).unwrap_or_else(|e| e)
}

fn redis_version() -> Option<String> {
    let url = std::env::var("DLOCK_TEST_REDIS_URL").ok()?;
    let mut c = redis::Client::open(url).ok()?.get_connection().ok()?;
    let info: String = redis::cmd("INFO").arg("server").query(&mut c).ok()?;
    info.lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .map(|v| format!("Redis {}", v.trim()))
}

fn main() {
    let args = args();
    let (round, rounds, window) = if args.quick {
        (Duration::from_millis(150), 3, Duration::from_millis(500))
    } else {
        (Duration::from_millis(300), 7, Duration::from_millis(1500))
    };
    let backends = support::backends();
    let redis = support::Redis::connect();
    let mut rows: BTreeMap<(usize, &'static str), Row> = BTreeMap::new();
    let order = |db: Db| backends.iter().position(|&d| d == db).unwrap();

    // Cycle: ours, raw and Redis in one rotation.
    for &db in &backends {
        for s in support::strategies(db) {
            let key = support::key("report");
            let mut p = raw::pair(db, s, &key);
            let rkey = support::key("report-redis");
            let mut redis_cycle = || {
                if let Some(r) = &redis {
                    r.cycle(&rkey, "token")
                }
            };
            let mut contestants: Vec<&mut dyn FnMut()> = vec![&mut p.ours, &mut p.raw];
            let with_redis = redis.is_some();
            if with_redis {
                contestants.push(&mut redis_cycle);
            }
            if let Some(silent) = &mut p.raw_without_notify {
                contestants.push(silent);
            }
            let bare_statements = p.bare.as_ref().map_or("", |b| b.1);
            let with_bare = p.bare.is_some();
            if let Some((bare, _)) = &mut p.bare {
                contestants.push(bare);
            }
            let bare_token_statements = p.bare_token.as_ref().map_or("", |b| b.1);
            let with_token = p.bare_token.is_some();
            if let Some((bare, _)) = &mut p.bare_token {
                contestants.push(bare);
            }
            let rates = support::interleaved(round, rounds, &mut contestants);
            let bare_at = rates.len() - 1 - usize::from(with_token);
            eprintln!("cycle {} {}: {rates:.0?}", db.name(), s.name());
            rows.insert(
                (order(db), s.name()),
                Row {
                    statements: p.statements,
                    ours: rates[0],
                    raw: rates[1],
                    redis: with_redis.then(|| rates[2]),
                    raw_silent: p
                        .raw_without_notify
                        .as_ref()
                        .map(|_| rates[if with_redis { 3 } else { 2 }]),
                    bare: with_bare.then(|| rates[bare_at]),
                    bare_statements,
                    bare_token: with_token.then(|| rates[rates.len() - 1]),
                    bare_token_statements,
                    ..Row::default()
                },
            );
        }
    }

    // Contention: 8 threads on one key, both ways of sharing, in rounds across all
    // strategies and backends; the median round of each.
    let mut runs: BTreeMap<Run, Vec<(f64, f64)>> = BTreeMap::new();
    let mut redis_runs: Vec<(f64, f64)> = Vec::new();
    let contention_rounds = if args.quick { 1 } else { 3 };
    for _ in 0..contention_rounds {
        if let Some(r) = support::redis_contend(8, &support::key("contention-redis"), window) {
            eprintln!(
                "contention redis: {:.0}/s fairness {:.2} {:?}",
                r.per_second(),
                r.fairness(),
                r.per_thread
            );
            redis_runs.push((r.per_second(), r.fairness()));
        }
        for &db in &backends {
            for s in support::strategies(db) {
                for sharing in [Sharing::OneLocker, Sharing::LockerPerThread] {
                    let lockers = support::lockers(db, s, 8, sharing);
                    let keys = vec![support::key("contention")];
                    let r = support::contend(&lockers, &keys, Stop::For(window));
                    eprintln!(
                        "contention {} {} {}: {:.0}/s fairness {:.2} {:?}",
                        db.name(),
                        s.name(),
                        sharing.name(),
                        r.per_second(),
                        r.fairness(),
                        r.per_thread
                    );
                    runs.entry((order(db), s.name(), sharing.name()))
                        .or_default()
                        .push((r.per_second(), r.fairness()));
                }
            }
        }
    }
    for ((o, s, sharing), v) in runs {
        let rate = support::median(&v.iter().map(|x| x.0).collect::<Vec<_>>());
        let fair = support::median(&v.iter().map(|x| x.1).collect::<Vec<_>>());
        let row = rows.get_mut(&(o, s)).unwrap();
        if sharing == Sharing::OneLocker.name() {
            row.shared = Some((rate, fair));
        } else {
            row.separate = Some((rate, fair));
        }
    }

    // Scale.
    let mut scale_lines = Vec::new();
    if args.scale {
        for &db in &backends {
            let lockers: Vec<_> = scale::strategies()
                .into_iter()
                .map(|s| (s, support::locker(db, s, 4)))
                .collect();
            scale::cleanup(db);
            let mut p50 = BTreeMap::new();
            for digits in [3u32, 6] {
                scale::fill(db, digits);
                for (s, l) in &lockers {
                    let key = support::key("scale");
                    let lat = scale::acquire_latencies(l, &key, 2000);
                    p50.insert((s.name(), digits), scale::p50(&lat));
                }
            }
            for (s, l) in &lockers {
                let t = std::time::Instant::now();
                let n = l.purge(Duration::from_secs(3600));
                let purge = t.elapsed();
                let (a, b) = (p50[&(s.name(), 3)], p50[&(s.name(), 6)]);
                scale_lines.push(format!(
                    "| {} | {} | {:.0} µs | {:.0} µs | {:.2} | {n} rows in {:.2} s |",
                    s.name(),
                    db.name(),
                    a.as_secs_f64() * 1e6,
                    b.as_secs_f64() * 1e6,
                    b.as_secs_f64() / a.as_secs_f64(),
                    purge.as_secs_f64()
                ));
            }
            scale::cleanup(db);
        }
    }

    // Kinds of lock: exclusive, readers, a semaphore of 3, 8 threads on one key with a
    // `Locker` each, each holding 1 ms.
    let mut kind_lines = Vec::new();
    for &db in &backends {
        for (strategy, offered) in support::kinds::strategies(db) {
            for kind in offered {
                let (rate, overlap) = kinds(db, strategy, kind, window);
                eprintln!(
                    "kinds {} {} {}: {rate:.0}/s overlap {overlap:.2}",
                    db.name(),
                    strategy.name(),
                    kind.name()
                );
                kind_lines.push(format!(
                    "| {} | {} | {} | {} | {overlap:.2} |",
                    db.name(),
                    strategy.name(),
                    kind.name(),
                    thousands(rate)
                ));
            }
        }
    }

    let redis_contention = (!redis_runs.is_empty()).then(|| {
        (
            support::median(&redis_runs.iter().map(|x| x.0).collect::<Vec<_>>()),
            support::median(&redis_runs.iter().map(|x| x.1).collect::<Vec<_>>()),
        )
    });
    let mut md = markdown(
        &args,
        &backends,
        &rows,
        &scale_lines,
        &kind_lines,
        redis_contention,
        (round, rounds, window),
    );
    // The long soak (examples/soak.rs) takes many minutes: its last report is kept in its own
    // file and carried over into this one.
    // So are the loss-notification latencies (examples/loss_latency.rs), the waiting across
    // processes (examples/wait_report.rs) and that of readers and permits
    // (examples/fair_kinds.rs), and storage after a purge (examples/storage_report.rs).
    for carried in [
        "docs/soak.md",
        "docs/loss.md",
        "docs/storage.md",
        "docs/waiting.md",
        "docs/scale.md",
        "docs/fair_kinds.md",
    ] {
        if let Ok(text) = std::fs::read_to_string(carried) {
            md.push('\n');
            md.push_str(&text);
        }
    }
    match &args.out {
        Some(path) => std::fs::write(path, &md).expect("write report"),
        None => print!("{md}"),
    }
    if let Some(path) = &args.svg {
        std::fs::write(path, svg(&backends, &rows)).expect("write chart");
    }
}

fn name(backends: &[Db], o: usize) -> &'static str {
    backends[o].name()
}

fn markdown(
    args: &Args,
    backends: &[Db],
    rows: &BTreeMap<(usize, &'static str), Row>,
    scale_lines: &[String],
    kind_lines: &[String],
    redis_contention: Option<(f64, f64)>,
    (round, rounds, window): (Duration, usize, Duration),
) -> String {
    let mut m = String::new();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut versions: Vec<String> = backends.iter().map(|&db| server_version(db)).collect();
    versions.extend(redis_version());
    writeln!(m, "# Benchmarks\n").unwrap();
    writeln!(
        m,
        "Produced by `cargo run --release --all-features --example bench_report -- --out BENCHMARKS.md --svg docs/handoffs.svg{}{}` \
         on {} (UTC), {cores} cores, everything on loopback; {}. The machine is shared and noisy: \
         each figure is the median of {rounds} interleaved rounds of {round:?} (ours, raw floor and \
         Redis in turn), contention the median of rounds of {window:?}. Ratios are within one run; \
         absolute figures move ±15% between runs. See docs/benchmarks.md for how to read this.\n",
        if args.scale { " --scale" } else { "" },
        if args.quick { " --quick" } else { "" },
        chrono::Utc::now().format("%Y-%m-%d %H:%M"),
        versions.join(", ")
    )
    .unwrap();
    writeln!(
        m,
        "## One uncontended acquire + release, and 8 threads on one key\n"
    )
    .unwrap();
    writeln!(
        m,
        "| strategy | backend | cycles/s | × raw floor | × Redis | 8 threads, one `Locker`: handoffs/s (fairness) | 8 threads, a `Locker` each: handoffs/s (fairness) |"
    )
    .unwrap();
    writeln!(m, "|---|---|---:|---:|---:|---:|---:|").unwrap();
    for ((o, s), r) in rows {
        let fmt = |x: Option<(f64, f64)>| {
            x.map_or("–".into(), |(h, f)| format!("{} ({f:.2})", thousands(h)))
        };
        writeln!(
            m,
            "| {s} | {} | {} | {:.2} | {} | {} | {} |",
            name(backends, *o),
            thousands(r.ours),
            r.ours / r.raw,
            r.redis.map_or("–".into(), |x| format!("{:.2}", r.ours / x)),
            fmt(r.shared),
            fmt(r.separate),
        )
        .unwrap();
    }
    if let Some(redis) = rows.values().find_map(|r| r.redis) {
        writeln!(m, "\nRedis `SET key token NX PX` + Lua compare-and-delete, same rotation: {} cycles/s (median over all rotations: {}).", thousands(redis), thousands(support::median(&rows.values().filter_map(|r| r.redis).collect::<Vec<_>>()))).unwrap();
    }
    writeln!(m, "\nThe raw floor of each row is these statements, issued directly through diesel (cached prepared statements, as the library does) on a connection of the same pool:\n").unwrap();
    writeln!(
        m,
        "| strategy | backend | raw floor cycles/s | statements |\n|---|---|---:|---|"
    )
    .unwrap();
    for ((o, s), r) in rows {
        writeln!(
            m,
            "| {s} | {} | {} | {} |",
            name(backends, *o),
            thousands(r.raw),
            r.statements
        )
        .unwrap();
    }
    let bare: Vec<_> = rows
        .iter()
        .filter_map(|((o, s), r)| r.bare.map(|b| (o, s, r, b)))
        .collect();
    if !bare.is_empty() {
        writeln!(m, "\nWhat the fencing token (and, for `row` and `lease`, the line) costs: each strategy against the lock alone, the minimal statements a user would write by hand, with no token counter and no line (same rotation):\n\n| strategy | backend | ours, cycles/s | lock alone, cycles/s | × lock alone | lock alone is |\n|---|---|---:|---:|---:|---|").unwrap();
        for (o, s, r, b) in bare {
            writeln!(
                m,
                "| {s} | {} | {} | {} | {:.2} | {} |",
                name(backends, *o),
                thousands(r.ours),
                thousands(b),
                r.ours / b,
                r.bare_statements
            )
            .unwrap();
        }
    }
    if let Some((h, f)) = redis_contention {
        writeln!(m, "\nRedis under contention, 8 threads on one key, a connection each (`SET NX PX`, sleep 1 ms and retry while held; Lua compare-and-delete): {} handoffs/s (fairness {f:.2}).", thousands(h)).unwrap();
    }
    let notify: Vec<_> = rows
        .iter()
        .filter_map(|((o, s), r)| r.raw_silent.map(|x| (o, s, r.raw, x)))
        .collect();
    if !notify.is_empty() {
        writeln!(m, "\nWhat the line costs a release with nobody waiting (raw floors, same rotation): `row`'s look into `dlock_waiters`, `lease`'s read of its row's `line_free` (a waiter in line sends the release to the hand-over statement, with its `pg_notify`):\n\n| strategy | backend | release minding the line, cycles/s | plain release, cycles/s | cost |\n|---|---|---:|---:|---:|").unwrap();
        for (o, s, with, without) in notify {
            writeln!(
                m,
                "| {s} | {} | {} | {} | {:+.1}% |",
                name(backends, *o),
                thousands(with),
                thousands(without),
                (without / with - 1.0) * 100.0
            )
            .unwrap();
        }
    }
    writeln!(m, "\nFairness is the fewest acquisitions of one thread over the most. \"One `Locker`\": the threads share a `Locker`, whose in-process queue hands the lock over locally. \"A `Locker` each\": every thread has its own `Locker` and pool, as separate processes would.\n").unwrap();
    if !kind_lines.is_empty() {
        writeln!(m, "## Kinds of lock: exclusive, shared, semaphore\n\n8 threads on one key, a `Locker` and pool (2 connections) each, every acquisition held 1 ms (`Lease`: ttl 10 s): acquisitions per second, and overlap, the mean number of holders at once (the sum of hold times over the window; at most 1 for the exclusive lock, 3 for a semaphore of 3, 8 for readers). The session strategies' semaphores take a free permit without waiting on the server, and pause between attempts while all are taken.\n").unwrap();
        writeln!(
            m,
            "| backend | strategy | kind | acquisitions/s | overlap |\n|---|---|---|---:|---:|"
        )
        .unwrap();
        for l in kind_lines {
            writeln!(m, "{l}").unwrap();
        }
        writeln!(m).unwrap();
    }
    if !scale_lines.is_empty() {
        writeln!(m, "## Scale\n\nAcquire latency (p50 of 2,000, each released before the next) with 10³ and then 10⁶ rows of other keys in `dlock_rows` and `dlock_leases`; then `Locker::purge` deleting them (rows two hours old; `Row` with `stale_after` = 1 h, leases idle ≥ 1 h).\n").unwrap();
        writeln!(m, "| strategy | backend | p50 at 10³ rows | p50 at 10⁶ rows | ratio | purge |\n|---|---|---:|---:|---:|---|").unwrap();
        for l in scale_lines {
            writeln!(m, "{l}").unwrap();
        }
        writeln!(m).unwrap();
    }
    targets(&mut m, backends, rows, redis_contention);
    writeln!(m, "## Handoffs per second, 8 threads on one key\n\n![handoffs/s per strategy × backend](docs/handoffs.svg)\n").unwrap();
    m
}

fn thousands(x: f64) -> String {
    let n = x.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A horizontal bar chart, hand-written so the report needs no plotting dependency.
fn svg(backends: &[Db], rows: &BTreeMap<(usize, &'static str), Row>) -> String {
    let bars: Vec<(String, f64, f64)> = rows
        .iter()
        .map(|((o, s), r)| {
            (
                format!("{s} · {}", name(backends, *o)),
                r.shared.map_or(0.0, |x| x.0),
                r.separate.map_or(0.0, |x| x.0),
            )
        })
        .collect();
    let max = bars.iter().flat_map(|b| [b.1, b.2]).fold(1.0f64, f64::max);
    let (left, width, row_h) = (190.0, 520.0, 34.0);
    let height = 60.0 + row_h * bars.len() as f64;
    let mut s = String::new();
    writeln!(s, r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="12">"#, left + width + 90.0).unwrap();
    writeln!(s, r##"<rect width="100%" height="100%" fill="#fff"/>"##).unwrap();
    writeln!(s, r#"<text x="10" y="18" font-size="14" font-weight="bold">Handoffs/s, 8 threads on one key</text>"#).unwrap();
    writeln!(s, r##"<rect x="{left}" y="28" width="10" height="10" fill="#4477aa"/><text x="{}" y="37">one Locker (in-process queue)</text>"##, left + 14.0).unwrap();
    writeln!(s, r##"<rect x="{}" y="28" width="10" height="10" fill="#ee8866"/><text x="{}" y="37">a Locker per thread (as processes)</text>"##, left + 220.0, left + 234.0).unwrap();
    for (i, (label, a, b)) in bars.iter().enumerate() {
        let y = 50.0 + row_h * i as f64;
        writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{label}</text>"#,
            left - 6.0,
            y + 16.0
        )
        .unwrap();
        for (j, (v, color)) in [(a, "#4477aa"), (b, "#ee8866")].iter().enumerate() {
            let w = width * *v / max;
            let yy = y + 2.0 + 14.0 * j as f64;
            writeln!(
                s,
                r#"<rect x="{left}" y="{yy}" width="{w:.1}" height="13" fill="{color}"/>"#
            )
            .unwrap();
            writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="10">{}</text>"#,
                left + w + 4.0,
                yy + 10.0,
                thousands(**v)
            )
            .unwrap();
        }
    }
    writeln!(s, "</svg>").unwrap();
    s
}

/// The issue's targets, as measured in this run.
fn targets(
    m: &mut String,
    backends: &[Db],
    rows: &BTreeMap<(usize, &'static str), Row>,
    redis_contention: Option<(f64, f64)>,
) {
    let get = |db: Db, s: &'static str| {
        backends
            .iter()
            .position(|&d| d == db)
            .and_then(|o| rows.get(&(o, s)))
    };
    let mark = |ok: bool| if ok { "met" } else { "**missed**" };
    writeln!(m, "## Targets, measured in this run\n").unwrap();
    let worst = rows
        .iter()
        .map(|((o, s), r)| (r.ours / r.raw, *o, *s))
        .min_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((x, o, s)) = worst {
        writeln!(
            m,
            "1. Cycle ≥ 0.95× its raw floor: lowest {x:.2} ({s} on {}): {}.",
            name(backends, o),
            mark(x >= 0.95)
        )
        .unwrap();
    }
    for db in [Db::Postgres, Db::Mysql] {
        if let Some(r) = get(db, "advisory") {
            if let Some(redis) = r.redis {
                writeln!(
                    m,
                    "2. Advisory on {} ≥ 1.0× Redis: {:.2}: {}.",
                    db.name(),
                    r.ours / redis,
                    mark(r.ours >= redis)
                )
                .unwrap();
            }
        }
    }
    if let Some(adv) = get(Db::Postgres, "advisory") {
        for s in ["row", "lease"] {
            if let Some(r) = get(Db::Postgres, s) {
                for (what, x, a) in [
                    ("one Locker", r.shared, adv.shared),
                    ("a Locker each", r.separate, adv.separate),
                ] {
                    if let (Some(x), Some(a)) = (x, a) {
                        writeln!(m, "3. PostgreSQL {s}, 8 threads ({what}) ≥ 0.5× advisory: {:.2} ({} vs {} handoffs/s): {}.", x.0 / a.0, thousands(x.0), thousands(a.0), mark(x.0 >= 0.5 * a.0)).unwrap();
                    }
                }
            }
        }
    }
    if let Some(r) = get(Db::Mysql, "row") {
        for (what, x) in [("one Locker", r.shared), ("a Locker each", r.separate)] {
            if let Some(x) = x {
                writeln!(
                    m,
                    "3. MariaDB row, 8 threads ({what}) ≥ 10× the naive 114/s: {:.1}×: {}.",
                    x.0 / 114.0,
                    mark(x.0 >= 1140.0)
                )
                .unwrap();
            }
        }
    }
    for (what, pick) in [("one Locker", 0usize), ("a Locker each", 1)] {
        let fair: Vec<(f64, usize, &str)> = rows
            .iter()
            .filter_map(|((o, s), r)| [r.shared, r.separate][pick].map(|x| (x.1, *o, *s)))
            .collect();
        if let Some((x, o, s)) = fair.iter().copied().min_by(|a, b| a.0.total_cmp(&b.0)) {
            let below: Vec<String> = fair
                .iter()
                .filter(|f| f.0 < 0.5)
                .map(|f| format!("{} on {} {:.2}", f.2, name(backends, f.1), f.0))
                .collect();
            writeln!(
                m,
                "4. Fairness ≥ 0.5, 8 threads, {what}: lowest {x:.2} ({s} on {}): {}{}.",
                name(backends, o),
                mark(below.is_empty()),
                if below.is_empty() {
                    String::new()
                } else {
                    format!(" (below: {})", below.join(", "))
                }
            )
            .unwrap();
        }
    }
    // The line's target: Row and Lease against the minimal hand-written statements.
    for db in backends.iter().copied() {
        for s in ["row", "lease"] {
            if let Some((r, bare)) = get(db, s).and_then(|r| r.bare.map(|b| (r, b))) {
                writeln!(
                    m,
                    "5. {s} on {} ≥ 0.9× the minimal hand-written statements ({}): {:.2}: {}.",
                    db.name(),
                    r.bare_statements,
                    r.ours / bare,
                    mark(r.ours >= 0.9 * bare)
                )
                .unwrap();
                if let Some(token) = r.bare_token {
                    writeln!(
                        m,
                        "   {s} on {}: the same with a fencing token ({}): {:.2} of the hand-written; the library {:.2} of it.",
                        db.name(),
                        r.bare_token_statements,
                        token / bare,
                        r.ours / token,
                    )
                    .unwrap();
                }
            }
        }
    }
    // The fencing-token targets: the session strategies against the lock alone.
    for db in [Db::Postgres, Db::Mysql] {
        for (s, floor) in [("advisory", 0.9), ("for-update", 0.8)] {
            if let Some((r, bare)) = get(db, s).and_then(|r| r.bare.map(|b| (r, b))) {
                writeln!(
                    m,
                    "5. {s} on {} ≥ {floor}× the lock with no token ({}): {:.2}: {}.",
                    db.name(),
                    r.bare_statements,
                    r.ours / bare,
                    mark(r.ours >= floor * bare)
                )
                .unwrap();
            }
        }
        if let (Some(r), Some((redis, _))) = (get(db, "advisory"), redis_contention) {
            for (what, x) in [("one Locker", r.shared), ("a Locker each", r.separate)] {
                if let Some((h, _)) = x {
                    writeln!(
                        m,
                        "6. Advisory on {}, 8 threads ({what}) ≥ 1.0× Redis 8 threads: {:.2} ({} vs {} handoffs/s): {}.",
                        db.name(),
                        h / redis,
                        thousands(h),
                        thousands(redis),
                        mark(h >= redis)
                    )
                    .unwrap();
                }
            }
        }
    }
    writeln!(m).unwrap();
}
