//! The floor of a fair hand-over across processes, written by hand: no `diesel_lock` code,
//! plain Diesel connections (no pool), the fewest statements a durable line of waiters
//! needs. 8 processes on one key, each releasing at once; the releaser's one transaction
//! gives the key to the first place in line (holder, token + 1, the place removed or
//! marked), then the releaser joins the line again. How the waiter learns of its grant is
//! what varies:
//!
//! - PostgreSQL: `pg_notify` to the waiter's own channel in the releasing statement; every
//!   waiter sleeps in `poll(2)` on a libpq connection of its own that `LISTEN`s, as the
//!   library's listener does, then reads the key's row once.
//! - MariaDB: the first in line looks at the key every 0 / 250 µs / 1 ms (those behind sleep
//!   500 µs per place ahead of them, at most 5 ms), or blocks in `GET_LOCK` on a named lock
//!   that the holder keeps while it holds and releases after its releasing commit.
//! - SQLite (WAL, the library's default pragmas, and `synchronous = FULL` for comparison):
//!   the first in line looks every 0 / 250 µs / 1 ms, or every waiter sleeps in `recv` on a
//!   Unix datagram socket of its own (abstract name) that the releaser rings after its commit.
//!
//! In the same run, interleaved: the one-thread cycle of the same statements (the statement
//! that takes a free key, then the release with nobody waiting), and 8 processes on the
//! server's own lock queue (`pg_advisory_lock`/`unlock`; `GET_LOCK`/`RELEASE_LOCK`).
//!
//! ```text
//! cargo run --release --all-features --example handover_floor -- \
//!     [--secs 3] [--rounds 3] [--pg URL] [--mysql URL] [--sqlite] [--only pg|mysql|sqlite]
//! ```
//! Without `--pg`/`--mysql`, the URLs come from `DLOCK_TEST_PG_URL` / `DLOCK_TEST_MYSQL_URL`.
//! The tables are the run's own (`hf_<pid>_<n>_keys`, `…_line`), made fresh for every
//! measurement and dropped after it.
#![allow(unsafe_code)]

use diesel::backend::Backend;
use diesel::connection::SimpleConnection;
use diesel::query_builder::{AstPass, Query, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{BigInt, HasSqlType, Nullable, Text, Untyped};
use diesel::{Connection, MysqlConnection, PgConnection, QueryResult, SqliteConnection};
use diesel::{OptionalExtension, QueryableByName, RunQueryDsl};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Processes on the key.
const PROCS: usize = 8;
/// The key.
const KEY: &str = "k";
/// How long a waiter that was promised a wake-up sleeps before it looks anyway.
const FALLBACK: Duration = Duration::from_millis(100);
/// A polling waiter's sleep per place ahead of it, and its most.
const BEHIND: Duration = Duration::from_micros(500);
const BEHIND_MAX: Duration = Duration::from_millis(5);

// ---------------------------------------------------------------------------------------
// A statement text with bound values, cached by the connection as a prepared statement.

/// One bound value.
enum Val {
    I(i64),
    N(Option<i64>),
    S(String),
}

/// `sql` with one value per `?`.
struct Q<'a> {
    sql: &'a str,
    binds: Vec<Val>,
}

fn q(sql: &str, binds: Vec<Val>) -> Q<'_> {
    Q { sql, binds }
}

impl<DB> QueryFragment<DB> for Q<'_>
where
    DB: Backend + HasSqlType<BigInt> + HasSqlType<Text>,
    i64: ToSql<BigInt, DB>,
    Option<i64>: ToSql<Nullable<BigInt>, DB>,
    String: ToSql<Text, DB>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, DB>) -> QueryResult<()> {
        let mut parts = self.sql.split('?');
        out.push_sql(parts.next().unwrap_or_default());
        for v in &self.binds {
            match v {
                Val::I(i) => out.push_bind_param::<BigInt, i64>(i)?,
                Val::N(n) => out.push_bind_param::<Nullable<BigInt>, Option<i64>>(n)?,
                Val::S(s) => out.push_bind_param::<Text, String>(s)?,
            }
            let next = parts.next().ok_or_else(|| {
                diesel::result::Error::QueryBuilderError("more values than placeholders".into())
            })?;
            out.push_sql(next);
        }
        if parts.next().is_some() {
            return Err(diesel::result::Error::QueryBuilderError(
                "fewer values than placeholders".into(),
            ));
        }
        Ok(())
    }
}

impl QueryId for Q<'_> {
    type QueryId = ();
    // Cached by its text.
    const HAS_STATIC_QUERY_ID: bool = false;
}

impl Query for Q<'_> {
    type SqlType = Untyped;
}

impl<C> RunQueryDsl<C> for Q<'_> {}

fn s(v: &str) -> Val {
    Val::S(v.to_owned())
}

#[derive(QueryableByName)]
struct Token {
    #[diesel(sql_type = BigInt)]
    token: i64,
}

#[derive(QueryableByName)]
struct Flag {
    #[diesel(sql_type = Nullable<BigInt>)]
    v: Option<i64>,
}

/// PostgreSQL's release: the key's token and new holder (none: not the holder; no holder:
/// freed), and the notifications sent.
#[derive(QueryableByName)]
struct Released {
    #[diesel(sql_type = Nullable<BigInt>)]
    token: Option<i64>,
    #[diesel(sql_type = Nullable<BigInt>)]
    holder: Option<i64>,
    #[diesel(sql_type = BigInt)]
    #[allow(dead_code)]
    woken: i64,
}

#[derive(QueryableByName)]
struct Look {
    #[diesel(sql_type = Nullable<BigInt>)]
    holder: Option<i64>,
    #[diesel(sql_type = BigInt)]
    token: i64,
    #[diesel(sql_type = BigInt)]
    ahead: i64,
}

/// CLOCK_MONOTONIC in ns: comparable across the processes of one machine.
fn now_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

// ---------------------------------------------------------------------------------------
// PostgreSQL: a libpq connection that LISTENs and blocks in poll(2), as the library's
// listener does (diesel's PgConnection can only poll for notifications).

struct Listener {
    conn: *mut pq_sys::PGconn,
}

impl Listener {
    fn connect(url: &str, channel: &str) -> Res<Listener> {
        let c = std::ffi::CString::new(url)?;
        // SAFETY: a NUL-terminated string that outlives the call.
        let conn = unsafe { pq_sys::PQconnectdb(c.as_ptr()) };
        let l = Listener { conn };
        // SAFETY: the connection object PQconnectdb returned (libpq accepts null here too).
        if conn.is_null()
            || unsafe { pq_sys::PQstatus(conn) } != pq_sys::ConnStatusType::CONNECTION_OK
        {
            return Err("listener: cannot connect".into());
        }
        // LISTEN takes no parameter: the channel is ours, letters, digits and '_'.
        let sql = std::ffi::CString::new(format!("LISTEN {channel}"))?;
        // SAFETY: a live connection; the result is cleared once.
        unsafe {
            let r = pq_sys::PQexec(conn, sql.as_ptr());
            let ok = pq_sys::PQresultStatus(r) == pq_sys::ExecStatusType::PGRES_COMMAND_OK;
            pq_sys::PQclear(r);
            if !ok {
                return Err("LISTEN failed".into());
            }
        }
        Ok(l)
    }

    /// Takes the notifications libpq has read; true if any.
    fn drain(&mut self) -> Res<bool> {
        let mut any = false;
        // SAFETY: a live connection, used by this thread only; each notification is freed
        // once.
        unsafe {
            if pq_sys::PQconsumeInput(self.conn) == 0 {
                return Err("listener: connection lost".into());
            }
            loop {
                let n = pq_sys::PQnotifies(self.conn);
                if n.is_null() {
                    return Ok(any);
                }
                pq_sys::PQfreemem(n.cast());
                any = true;
            }
        }
    }

    /// Waits for a notification at most `timeout`; true if one came.
    fn wait(&mut self, timeout: Duration) -> Res<bool> {
        if self.drain()? {
            return Ok(true);
        }
        // SAFETY: a live connection.
        let fd = unsafe { pq_sys::PQsocket(self.conn) };
        let mut p = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd that outlives the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n > 0 {
            return self.drain();
        }
        Ok(false)
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // SAFETY: the connection is ours and not used after this.
        unsafe { pq_sys::PQfinish(self.conn) };
    }
}

// ---------------------------------------------------------------------------------------
// The ring: what each process does, per backend.

/// A grant learnt: the token, and when the waiter learnt it (before the read that
/// confirmed it).
struct Grant {
    token: i64,
    woke: i64,
}

trait Ring {
    /// Takes the key if free and nobody waits (`Some(token)`), else joins the line.
    fn join(&mut self, hid: i64) -> Res<Option<i64>>;
    /// Waits in line until granted.
    fn wait(&mut self) -> Res<Grant>;
    /// Releases, handing the key to the first place if any: `Some(token handed)`.
    fn release(&mut self) -> Res<Option<i64>>;
    /// Looks, waits that ended on a fallback timer, and statements run again (MariaDB: after
    /// a deadlock; SQLite: the write lock taken).
    fn stats(&self) -> (u64, u64, u64);
}

/// Table names of one measurement.
fn tables(prefix: &str) -> (String, String) {
    (format!("{prefix}_keys"), format!("{prefix}_line"))
}

struct PgRing {
    c: PgConnection,
    l: Listener,
    channel: String,
    hid: i64,
    place: i64,
    join_sql: String,
    release_sql: String,
    look_sql: String,
    take_sql: String,
    looks: u64,
    fallbacks: u64,
    retries: u64,
}

impl PgRing {
    /// `no_sync`: `synchronous_commit = off` (a diagnosis of what the commit's flush costs,
    /// not a floor: the tokens are not durable then).
    fn new(url: &str, prefix: &str, idx: usize, no_sync: bool) -> Res<PgRing> {
        let mut c = PgConnection::establish(url)?;
        if no_sync {
            c.batch_execute("SET synchronous_commit = off")?;
        }
        let (k, l) = tables(prefix);
        let channel = format!("{prefix}_w{idx}");
        Ok(PgRing {
            c,
            l: Listener::connect(url, &channel)?,
            channel,
            hid: 0,
            place: 0,
            join_sql: format!(
                "WITH u AS (UPDATE {k} SET holder = ?, token = token + 1 \
                   WHERE lock_key = ? AND holder IS NULL \
                   AND NOT EXISTS (SELECT 1 FROM {l} WHERE lock_key = ?) RETURNING token), \
                 i AS (INSERT INTO {l} (lock_key, holder, channel) SELECT ?, ?, ? \
                   WHERE NOT EXISTS (SELECT 1 FROM u) RETURNING id) \
                 SELECT COALESCE((SELECT token FROM u), -(SELECT id FROM i)) AS v"
            ),
            release_sql: format!(
                "WITH w AS (SELECT id, holder, channel FROM {l} WHERE lock_key = ? \
                   ORDER BY id LIMIT 1 FOR UPDATE), \
                 g AS (UPDATE {k} SET holder = (SELECT holder FROM w), \
                   token = token + (SELECT count(*) FROM w) \
                   WHERE lock_key = ? AND holder = ? RETURNING token, holder), \
                 d AS (DELETE FROM {l} WHERE id = (SELECT id FROM w) \
                   AND EXISTS (SELECT 1 FROM g)), \
                 n AS (SELECT pg_notify(w.channel, '') FROM w WHERE EXISTS (SELECT 1 FROM g)) \
                 SELECT (SELECT token FROM g) AS token, (SELECT holder FROM g) AS holder, \
                   (SELECT count(*) FROM n) AS woken"
            ),
            look_sql: format!("SELECT token FROM {k} WHERE lock_key = ? AND holder = ?"),
            take_sql: format!(
                "WITH u AS (UPDATE {k} SET holder = ?, token = token + 1 \
                   WHERE lock_key = ? AND holder IS NULL \
                   AND NOT EXISTS (SELECT 1 FROM {l} WHERE lock_key = ? AND id < ?) \
                   RETURNING token), \
                 d AS (DELETE FROM {l} WHERE id = ? AND EXISTS (SELECT 1 FROM u)) \
                 SELECT token FROM u"
            ),
            looks: 0,
            fallbacks: 0,
            retries: 0,
        })
    }

    fn look(&mut self) -> Res<Option<i64>> {
        self.looks += 1;
        Ok(q(&self.look_sql, vec![s(KEY), Val::I(self.hid)])
            .get_result::<Token>(&mut self.c)
            .optional()?
            .map(|t| t.token))
    }
}

impl Ring for PgRing {
    fn join(&mut self, hid: i64) -> Res<Option<i64>> {
        self.hid = hid;
        let binds = vec![
            Val::I(hid),
            s(KEY),
            s(KEY),
            s(KEY),
            Val::I(hid),
            Val::S(self.channel.clone()),
        ];
        let v = q(&self.join_sql, binds)
            .get_result::<Flag>(&mut self.c)?
            .v
            .ok_or("join: no result")?;
        if v > 0 {
            Ok(Some(v))
        } else {
            self.place = -v;
            Ok(None)
        }
    }

    fn wait(&mut self) -> Res<Grant> {
        loop {
            let heard = self.l.wait(FALLBACK)?;
            let woke = now_ns();
            if let Some(token) = self.look()? {
                return Ok(Grant { token, woke });
            }
            if !heard {
                self.fallbacks += 1;
                let binds = vec![
                    Val::I(self.hid),
                    s(KEY),
                    s(KEY),
                    Val::I(self.place),
                    Val::I(self.place),
                ];
                if let Some(t) = q(&self.take_sql, binds)
                    .get_result::<Token>(&mut self.c)
                    .optional()?
                {
                    return Ok(Grant {
                        token: t.token,
                        woke,
                    });
                }
            }
        }
    }

    fn release(&mut self) -> Res<Option<i64>> {
        let r = q(&self.release_sql, vec![s(KEY), s(KEY), Val::I(self.hid)])
            .get_result::<Released>(&mut self.c)?;
        let token = r.token.ok_or("release: not the holder")?;
        Ok(r.holder.map(|_| token))
    }

    fn stats(&self) -> (u64, u64, u64) {
        (self.looks, self.fallbacks, self.retries)
    }
}

/// How a waiter of MariaDB or SQLite learns of its grant.
#[derive(Clone, Copy, PartialEq)]
enum Wake {
    /// The first in line looks every so often (0: back to back).
    Poll(Duration),
    /// MariaDB: the first in line blocks in GET_LOCK on the holder's named lock.
    GetLock,
    /// SQLite: a datagram from the releaser.
    Bell,
}

fn parse_wake(v: &str) -> Res<Wake> {
    Ok(match v {
        "getlock" => Wake::GetLock,
        "bell" => Wake::Bell,
        _ => Wake::Poll(Duration::from_micros(
            v.strip_prefix("poll")
                .ok_or("unknown wake-up")?
                .parse::<u64>()?,
        )),
    })
}

/// Runs `f` again after a deadlock (InnoDB rolled the statement back), counting it.
fn retried<T>(retries: &mut u64, mut f: impl FnMut() -> QueryResult<T>) -> QueryResult<T> {
    loop {
        match f() {
            Err(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::SerializationFailure,
                _,
            )) => *retries += 1,
            r => return r,
        }
    }
}

fn behind(ahead: i64) -> Duration {
    (BEHIND * u32::try_from(ahead).unwrap_or(u32::MAX)).min(BEHIND_MAX)
}

struct MyRing {
    c: MysqlConnection,
    wake: Wake,
    wake_name: String,
    holds_wake: bool,
    idx: usize,
    hid: i64,
    token: i64,
    join_sql: String,
    look_sql: String,
    take_sql: String,
    release_sql: String,
    looks: u64,
    fallbacks: u64,
    retries: u64,
}

impl MyRing {
    fn new(url: &str, prefix: &str, idx: usize, wake: Wake) -> Res<MyRing> {
        let (k, l) = tables(prefix);
        let mut c = MysqlConnection::establish(url)?;
        // No gap locks: the line's inserts and the release's read of the first place do not
        // hold each other up.
        c.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")?;
        Ok(MyRing {
            c,
            wake,
            wake_name: format!("{prefix}-wake"),
            holds_wake: false,
            idx,
            hid: 0,
            token: 0,
            join_sql: format!("REPLACE INTO {l} (lock_key, who, holder) VALUES (?, ?, ?)"),
            look_sql: format!(
                "SELECT k.holder, k.token, (SELECT count(*) FROM {l} w \
                   WHERE w.lock_key = ? AND w.granted = 0 \
                   AND w.id < (SELECT id FROM {l} WHERE who = ?)) AS ahead \
                 FROM {k} k WHERE k.lock_key = ?"
            ),
            take_sql: format!(
                "UPDATE {k} k JOIN {l} w ON w.who = ? \
                 SET k.holder = w.holder, k.token = k.token + 1, w.granted = 1 \
                 WHERE k.lock_key = ? AND k.holder IS NULL AND w.granted = 0"
            ),
            release_sql: my_release_sql(prefix),
            looks: 0,
            fallbacks: 0,
            retries: 0,
        })
    }

    fn get_wake(&mut self, timeout: i64) -> Res<bool> {
        let got = q(
            "SELECT CAST(GET_LOCK(?, ?) AS SIGNED) AS v",
            vec![Val::S(self.wake_name.clone()), Val::I(timeout)],
        )
        .get_result::<Flag>(&mut self.c)?
        .v;
        self.holds_wake = got == Some(1);
        Ok(self.holds_wake)
    }

    fn drop_wake(&mut self) -> Res<()> {
        q("DO RELEASE_LOCK(?)", vec![Val::S(self.wake_name.clone())]).execute(&mut self.c)?;
        self.holds_wake = false;
        Ok(())
    }

    fn look(&mut self) -> Res<Look> {
        self.looks += 1;
        let binds = vec![s(KEY), Val::I(self.idx as i64), s(KEY)];
        Ok(q(&self.look_sql, binds).get_result::<Look>(&mut self.c)?)
    }

    fn granted(&mut self, token: i64, woke: i64) -> Res<Grant> {
        self.token = token;
        if self.wake == Wake::GetLock && !self.holds_wake {
            self.get_wake(5)?;
        }
        Ok(Grant { token, woke })
    }
}

/// The MariaDB release: the key to the first place not granted yet (marked granted), or to
/// nobody. One autocommit statement. Binds: key, key, holder.
fn my_release_sql(prefix: &str) -> String {
    let (k, l) = tables(prefix);
    format!(
        "UPDATE {k} k LEFT JOIN {l} w ON w.id = \
           (SELECT min(id) FROM {l} WHERE lock_key = ? AND granted = 0) \
         SET k.holder = w.holder, k.token = k.token + (w.id IS NOT NULL), w.granted = 1 \
         WHERE k.lock_key = ? AND k.holder = ?"
    )
}

impl Ring for MyRing {
    fn join(&mut self, hid: i64) -> Res<Option<i64>> {
        self.hid = hid;
        let (c, sql, idx) = (&mut self.c, &self.join_sql, self.idx as i64);
        retried(&mut self.retries, || {
            q(sql, vec![s(KEY), Val::I(idx), Val::I(hid)]).execute(c)
        })?;
        Ok(None) // the first look takes a free key
    }

    fn wait(&mut self) -> Res<Grant> {
        loop {
            let woke = now_ns();
            let l = self.look()?;
            if l.holder == Some(self.hid) {
                return self.granted(l.token, woke);
            }
            if l.holder.is_none() && l.ahead == 0 {
                let (c, sql, idx) = (&mut self.c, &self.take_sql, self.idx as i64);
                let n = retried(&mut self.retries, || {
                    q(sql, vec![Val::I(idx), s(KEY)]).execute(c)
                })?;
                if n > 0 {
                    return self.granted(l.token + 1, woke);
                }
                continue;
            }
            if l.ahead > 0 {
                std::thread::sleep(behind(l.ahead));
                continue;
            }
            match self.wake {
                Wake::Poll(d) if d.is_zero() => {}
                Wake::Poll(d) => std::thread::sleep(d),
                Wake::GetLock | Wake::Bell => {
                    if self.get_wake(1)? {
                        let woke = now_ns();
                        let l = self.look()?;
                        if l.holder == Some(self.hid) {
                            return self.granted(l.token, woke);
                        }
                        // The holder has not taken the wake lock yet.
                        self.drop_wake()?;
                        std::thread::sleep(Duration::from_micros(100));
                    } else {
                        self.fallbacks += 1;
                    }
                }
            }
        }
    }

    fn release(&mut self) -> Res<Option<i64>> {
        let (c, sql, hid) = (&mut self.c, &self.release_sql, self.hid);
        let n = retried(&mut self.retries, || {
            q(sql, vec![s(KEY), s(KEY), Val::I(hid)]).execute(c)
        })?;
        if self.holds_wake {
            self.drop_wake()?;
        }
        match n {
            0 => Err("release: not the holder".into()),
            1 => Ok(None),
            _ => Ok(Some(self.token + 1)),
        }
    }

    fn stats(&self) -> (u64, u64, u64) {
        (self.looks, self.fallbacks, self.retries)
    }
}

const SQLITE_NORMAL: &str =
    "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL; PRAGMA synchronous = NORMAL;";
const SQLITE_FULL: &str =
    "PRAGMA busy_timeout = 5000; PRAGMA journal_mode = WAL; PRAGMA synchronous = FULL;";

fn sqlite_open(path: &str, full: bool) -> Res<SqliteConnection> {
    let mut c = SqliteConnection::establish(path)?;
    c.batch_execute(if full { SQLITE_FULL } else { SQLITE_NORMAL })?;
    Ok(c)
}

/// A ring's SQLite connection: the pragmas, then the busy handler off; its writes wait for
/// the write lock in `lite_retry`'s steps of microseconds, as the library's do (the busy
/// handler's 1, 2, 5 … 100 ms sleeps starve a writer that keeps colliding).
fn lite_ring_open(path: &str, full: bool) -> Res<SqliteConnection> {
    let mut c = sqlite_open(path, full)?;
    c.batch_execute("PRAGMA busy_timeout = 0")?;
    Ok(c)
}

/// Runs `f` again while SQLite says the database is locked, after a pause doubling from
/// 16 µs to 250 µs, for at most 5 s; counts the tries again.
fn lite_retry<T>(retries: &mut u64, mut f: impl FnMut() -> QueryResult<T>) -> QueryResult<T> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(16);
    loop {
        match f() {
            Err(diesel::result::Error::DatabaseError(_, info))
                if (info.message().contains("locked") || info.message().contains("busy"))
                    && start.elapsed() < Duration::from_secs(5) =>
            {
                *retries += 1;
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(250));
            }
            r => return r,
        }
    }
}

fn bell_name(prefix: &str, idx: i64) -> String {
    format!("{prefix}-bell-{idx}")
}

#[derive(QueryableByName)]
struct Placed {
    #[diesel(sql_type = BigInt)]
    holder: i64,
    #[diesel(sql_type = BigInt)]
    who: i64,
}

/// The SQLite release, one transaction: the first place goes, the key to its holder with
/// the next token, or to nobody. `Some((token, who))` if handed.
fn lite_release(
    c: &mut SqliteConnection,
    sql: &(String, String),
    hid: i64,
) -> QueryResult<Option<(i64, i64)>> {
    c.immediate_transaction(|c| {
        let w = q(&sql.0, vec![s(KEY)]).get_result::<Placed>(c).optional()?;
        let binds = vec![
            Val::N(w.as_ref().map(|w| w.holder)),
            Val::I(i64::from(w.is_some())),
            s(KEY),
            Val::I(hid),
        ];
        let t = q(&sql.1, binds).get_result::<Token>(c)?;
        QueryResult::Ok(w.map(|w| (t.token, w.who)))
    })
}

fn lite_release_sql(prefix: &str) -> (String, String) {
    let (k, l) = tables(prefix);
    (
        format!(
            "DELETE FROM {l} WHERE id = (SELECT id FROM {l} WHERE lock_key = ? \
             ORDER BY id LIMIT 1) RETURNING holder, who"
        ),
        format!(
            "UPDATE {k} SET holder = ?, token = token + ? WHERE lock_key = ? AND holder = ? \
             RETURNING token"
        ),
    )
}

struct LiteRing {
    c: SqliteConnection,
    wake: Wake,
    prefix: String,
    bell: Option<UnixDatagram>,
    out: UnixDatagram,
    idx: usize,
    hid: i64,
    place: i64,
    join_sql: String,
    look_sql: String,
    take_sql: (String, String),
    release_sql: (String, String),
    looks: u64,
    fallbacks: u64,
    retries: u64,
}

impl LiteRing {
    fn new(path: &str, prefix: &str, idx: usize, wake: Wake, full: bool) -> Res<LiteRing> {
        let (k, l) = tables(prefix);
        let bell = if wake == Wake::Bell {
            let name = bell_name(prefix, idx as i64);
            let b = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
            b.set_read_timeout(Some(FALLBACK))?;
            Some(b)
        } else {
            None
        };
        Ok(LiteRing {
            c: lite_ring_open(path, full)?,
            wake,
            prefix: prefix.to_owned(),
            bell,
            out: UnixDatagram::unbound()?,
            idx,
            hid: 0,
            place: 0,
            join_sql: format!(
                "INSERT INTO {l} (lock_key, who, holder) VALUES (?, ?, ?) RETURNING id AS token"
            ),
            look_sql: format!(
                "SELECT k.holder, k.token, \
                   (SELECT count(*) FROM {l} WHERE lock_key = ? AND id < ?) AS ahead \
                 FROM {k} k WHERE k.lock_key = ?"
            ),
            take_sql: (
                format!(
                    "UPDATE {k} SET holder = ?, token = token + 1 \
                     WHERE lock_key = ? AND holder IS NULL RETURNING token"
                ),
                format!("DELETE FROM {l} WHERE id = ?"),
            ),
            release_sql: lite_release_sql(prefix),
            looks: 0,
            fallbacks: 0,
            retries: 0,
        })
    }

    fn look(&mut self) -> Res<Look> {
        self.looks += 1;
        let (c, sql, place) = (&mut self.c, &self.look_sql, self.place);
        Ok(lite_retry(&mut self.retries, || {
            q(sql, vec![s(KEY), Val::I(place), s(KEY)]).get_result::<Look>(c)
        })?)
    }

    fn take(&mut self) -> Res<Option<i64>> {
        let (hid, place) = (self.hid, self.place);
        let (c, sql) = (&mut self.c, &self.take_sql);
        let t = lite_retry(&mut self.retries, || {
            c.immediate_transaction(|c| {
                let t = q(&sql.0, vec![Val::I(hid), s(KEY)])
                    .get_result::<Token>(c)
                    .optional()?;
                if t.is_some() {
                    q(&sql.1, vec![Val::I(place)]).execute(c)?;
                }
                QueryResult::Ok(t.map(|t| t.token))
            })
        })?;
        Ok(t)
    }
}

impl Ring for LiteRing {
    fn join(&mut self, hid: i64) -> Res<Option<i64>> {
        self.hid = hid;
        let (c, sql, idx) = (&mut self.c, &self.join_sql, self.idx as i64);
        self.place = lite_retry(&mut self.retries, || {
            q(sql, vec![s(KEY), Val::I(idx), Val::I(hid)]).get_result::<Token>(c)
        })?
        .token;
        Ok(None) // the first look takes a free key
    }

    fn wait(&mut self) -> Res<Grant> {
        let mut first = true;
        loop {
            let woke = now_ns();
            let l = self.look()?;
            if l.holder == Some(self.hid) {
                return Ok(Grant {
                    token: l.token,
                    woke,
                });
            }
            if l.holder.is_none() && l.ahead == 0 {
                if let Some(token) = self.take()? {
                    return Ok(Grant { token, woke });
                }
                continue;
            }
            match self.wake {
                Wake::Bell => {
                    let mut buf = [0u8; 8];
                    match self.bell.as_ref().ok_or("no bell")?.recv(&mut buf) {
                        Ok(_) => {}
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                            ) =>
                        {
                            if !first {
                                self.fallbacks += 1;
                            }
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                _ if l.ahead > 0 => std::thread::sleep(behind(l.ahead)),
                Wake::Poll(d) if d.is_zero() => {}
                Wake::Poll(d) => std::thread::sleep(d),
                Wake::GetLock => return Err("no GET_LOCK on SQLite".into()),
            }
            first = false;
        }
    }

    fn release(&mut self) -> Res<Option<i64>> {
        let (c, sql, hid) = (&mut self.c, &self.release_sql, self.hid);
        let r = lite_retry(&mut self.retries, || lite_release(c, sql, hid))?;
        if let (Some((_, who)), Wake::Bell) = (r, self.wake) {
            let name = bell_name(&self.prefix, who);
            // A bell that cannot ring is the waiter's fallback look's to make up for.
            let _ = self
                .out
                .send_to_addr(b"g", &SocketAddr::from_abstract_name(name.as_bytes())?);
        }
        Ok(r.map(|(t, _)| t))
    }

    fn stats(&self) -> (u64, u64, u64) {
        (self.looks, self.fallbacks, self.retries)
    }
}

// ---------------------------------------------------------------------------------------
// Children.

/// What a child reports: its acquisitions within the time, its looks and fallbacks, and
/// its events (`H token sent acked` for a hand-over it made, `G token woke held` for a grant
/// it received).
fn child(args: &[String]) -> Res<()> {
    let [backend, variant, target, prefix, idx, secs, ..] = args else {
        return Err("child: arguments".into());
    };
    let idx: usize = idx.parse()?;
    let secs: f64 = secs.parse()?;
    let mut out = String::new();
    match variant.as_str() {
        "advisory" | "getlock8" => {
            let mut body: Box<dyn FnMut() -> Res<()>> = if backend == "pg" {
                let mut c = PgConnection::establish(target)?;
                Box::new(move || {
                    q("SELECT pg_advisory_lock(?)", vec![Val::I(42)]).execute(&mut c)?;
                    q("SELECT pg_advisory_unlock(?)", vec![Val::I(42)]).execute(&mut c)?;
                    Ok(())
                })
            } else {
                let mut c = MysqlConnection::establish(target)?;
                let name = format!("{prefix}-lock");
                Box::new(move || {
                    let got = q(
                        "SELECT CAST(GET_LOCK(?, 10) AS SIGNED) AS v",
                        vec![Val::S(name.clone())],
                    )
                    .get_result::<Flag>(&mut c)?
                    .v;
                    if got != Some(1) {
                        return Err("GET_LOCK timed out".into());
                    }
                    q(
                        "SELECT CAST(RELEASE_LOCK(?) AS SIGNED) AS v",
                        vec![Val::S(name.clone())],
                    )
                    .execute(&mut c)?;
                    Ok(())
                })
            };
            let deadline = ready_go(secs)?;
            let mut n = 0u64;
            // The count is of the locks taken within the time (each released at once).
            loop {
                body()?;
                if Instant::now() >= deadline {
                    break;
                }
                n += 1;
            }
            out.push_str(&format!("count {n}\nlooks 0\nfallbacks 0\nretries 0\n"));
        }
        _ => {
            // A suffix: SQLite `synchronous = FULL`, PostgreSQL `synchronous_commit = off`.
            let (wake, full) = match variant.split_once('-') {
                Some((w, _)) => (w, true),
                _ => (variant.as_str(), false),
            };
            let mut ring: Box<dyn Ring> = match backend.as_str() {
                "pg" => Box::new(PgRing::new(target, prefix, idx, full)?),
                "mysql" => Box::new(MyRing::new(target, prefix, idx, parse_wake(wake)?)?),
                _ => Box::new(LiteRing::new(target, prefix, idx, parse_wake(wake)?, full)?),
            };
            let deadline = ready_go(secs)?;
            let mut n = 0u64;
            let mut seq = 0i64;
            loop {
                seq += 1;
                let hid = ((idx as i64 + 1) << 32) | seq;
                let got = ring.join(hid)?;
                let (token, woke) = match got {
                    Some(t) => (t, 0),
                    None => {
                        let g = ring.wait()?;
                        (g.token, g.woke)
                    }
                };
                let held = now_ns();
                let late = Instant::now() >= deadline;
                if !late {
                    n += 1;
                    if woke != 0 {
                        out.push_str(&format!("G {token} {woke} {held}\n"));
                    }
                }
                let sent = now_ns();
                let handed = ring.release()?;
                let acked = now_ns();
                if let (Some(t), false) = (handed, late) {
                    out.push_str(&format!("H {t} {sent} {acked}\n"));
                }
                if late {
                    break;
                }
            }
            let (looks, fallbacks, retries) = ring.stats();
            out.push_str(&format!(
                "count {n}\nlooks {looks}\nfallbacks {fallbacks}\nretries {retries}\n"
            ));
        }
    }
    let mut so = std::io::stdout().lock();
    so.write_all(out.as_bytes())?;
    so.flush()?;
    Ok(())
}

/// Says "ready", waits for the parent's line, returns the deadline.
fn ready_go(secs: f64) -> Res<Instant> {
    println!("ready");
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line)?;
    Ok(Instant::now() + Duration::from_secs_f64(secs))
}

// ---------------------------------------------------------------------------------------
// The parent.

/// One measurement across processes.
struct Run {
    rate: f64,
    min: u64,
    max: u64,
    looks: u64,
    fallbacks: u64,
    retries: u64,
    /// Per hand-over: commit acknowledged → waiter woke, release sent → waiter holds (ns).
    lat: Vec<(i64, i64)>,
}

fn spawn_ring(backend: &str, variant: &str, target: &str, prefix: &str, secs: f64) -> Res<Run> {
    let exe = std::env::current_exe()?;
    let mut kids: Vec<Child> = Vec::new();
    for i in 0..PROCS {
        kids.push(
            Command::new(&exe)
                .args([
                    "--child",
                    backend,
                    variant,
                    target,
                    prefix,
                    &i.to_string(),
                    &secs.to_string(),
                ])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()?,
        );
    }
    let mut readers = Vec::new();
    for k in &mut kids {
        let mut r = BufReader::new(k.stdout.take().ok_or("no stdout")?);
        let mut line = String::new();
        r.read_line(&mut line)?;
        if line.trim() != "ready" {
            return Err(format!("child not ready: {line:?}").into());
        }
        readers.push(r);
    }
    for k in &mut kids {
        writeln!(k.stdin.as_mut().ok_or("no stdin")?, "go")?;
    }
    let handles: Vec<_> = readers
        .into_iter()
        .map(|mut r| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut r, &mut s);
                s
            })
        })
        .collect();
    let mut counts = Vec::new();
    let (mut looks, mut fallbacks, mut retries) = (0, 0, 0);
    let mut handed: HashMap<i64, (i64, i64)> = HashMap::new();
    let mut got: Vec<(i64, i64, i64)> = Vec::new();
    for (k, h) in kids.iter_mut().zip(handles) {
        let text = h.join().map_err(|_| "reader panicked")?;
        let status = k.wait()?;
        if !status.success() {
            return Err(format!("child failed: {status}").into());
        }
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                ["count", n] => counts.push(n.parse::<u64>()?),
                ["looks", n] => looks += n.parse::<u64>()?,
                ["fallbacks", n] => fallbacks += n.parse::<u64>()?,
                ["retries", n] => retries += n.parse::<u64>()?,
                ["H", t, a, b] => {
                    handed.insert(t.parse()?, (a.parse()?, b.parse()?));
                }
                ["G", t, a, b] => got.push((t.parse()?, a.parse()?, b.parse()?)),
                _ => return Err(format!("child said {line:?}").into()),
            }
        }
    }
    let lat = got
        .iter()
        .filter_map(|(t, woke, held)| {
            handed
                .get(t)
                .map(|(sent, acked)| (woke - acked, held - sent))
        })
        .collect();
    Ok(Run {
        rate: counts.iter().sum::<u64>() as f64 / secs,
        min: *counts.iter().min().unwrap_or(&0),
        max: *counts.iter().max().unwrap_or(&0),
        looks,
        fallbacks,
        retries,
        lat,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Db {
    Pg,
    My,
    Lite,
}

impl Db {
    fn name(self) -> &'static str {
        match self {
            Db::Pg => "pg",
            Db::My => "mysql",
            Db::Lite => "sqlite",
        }
    }
}

/// Creates the tables of one measurement (and the key's row, free).
fn create(db: Db, target: &str, prefix: &str, full: bool) -> Res<()> {
    let (k, l) = tables(prefix);
    match db {
        Db::Pg => PgConnection::establish(target)?.batch_execute(&format!(
            "CREATE TABLE {k} (lock_key text PRIMARY KEY, holder bigint, \
               token bigint NOT NULL DEFAULT 0); \
             CREATE TABLE {l} (id bigserial PRIMARY KEY, lock_key text NOT NULL, \
               holder bigint NOT NULL, channel text NOT NULL); \
             CREATE INDEX ON {l} (lock_key, id); \
             INSERT INTO {k} (lock_key) VALUES ('{KEY}');"
        ))?,
        Db::My => MysqlConnection::establish(target)?.batch_execute(&format!(
            "CREATE TABLE {k} (lock_key varchar(64) PRIMARY KEY, holder bigint NULL, \
               token bigint NOT NULL DEFAULT 0) ENGINE=InnoDB; \
             CREATE TABLE {l} (id bigint AUTO_INCREMENT PRIMARY KEY, \
               lock_key varchar(64) NOT NULL, who int NOT NULL, holder bigint NOT NULL, \
               granted tinyint NOT NULL DEFAULT 0, UNIQUE KEY (who), \
               KEY (lock_key, granted, id)) ENGINE=InnoDB; \
             INSERT INTO {k} (lock_key) VALUES ('{KEY}');"
        ))?,
        Db::Lite => sqlite_open(target, full)?.batch_execute(&format!(
            "CREATE TABLE {k} (lock_key TEXT PRIMARY KEY, holder INTEGER, \
               token INTEGER NOT NULL DEFAULT 0); \
             CREATE TABLE {l} (id INTEGER PRIMARY KEY, lock_key TEXT NOT NULL, \
               who INTEGER NOT NULL, holder INTEGER NOT NULL); \
             CREATE INDEX {l}_k ON {l} (lock_key, id); \
             INSERT INTO {k} (lock_key) VALUES ('{KEY}');"
        ))?,
    }
    Ok(())
}

fn drop_tables(db: Db, target: &str, prefix: &str) -> Res<()> {
    let (k, l) = tables(prefix);
    let sql = format!("DROP TABLE IF EXISTS {k}; DROP TABLE IF EXISTS {l};");
    match db {
        Db::Pg => PgConnection::establish(target)?.batch_execute(&sql)?,
        Db::My => MysqlConnection::establish(target)?.batch_execute(&sql)?,
        Db::Lite => sqlite_open(target, false)?.batch_execute(&sql)?,
    }
    Ok(())
}

/// The one-thread cycle of the ring's statements: take the free key, release with nobody
/// waiting. Cycles per second.
fn cycle(db: Db, target: &str, prefix: &str, secs: f64, full: bool) -> Res<f64> {
    let (k, l) = tables(prefix);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut n = 0u64;
    let mut hid = 1i64;
    match db {
        Db::Pg => {
            // The ring's own join (which takes a free key) and release.
            let mut r = PgRing::new(target, prefix, 99, full)?;
            while Instant::now() < end {
                hid += 1;
                r.join(hid)?.ok_or("cycle: key not free")?;
                if r.release()?.is_some() {
                    return Err("cycle: handed".into());
                }
                n += 1;
            }
        }
        Db::My => {
            let mut c = MysqlConnection::establish(target)?;
            c.batch_execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")?;
            let take = format!(
                "UPDATE {k} SET holder = ?, token = token + 1 \
                 WHERE lock_key = ? AND holder IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM {l} WHERE lock_key = ? AND granted = 0)"
            );
            let release = my_release_sql(prefix);
            while Instant::now() < end {
                hid += 1;
                let t = q(&take, vec![Val::I(hid), s(KEY), s(KEY)]).execute(&mut c)?;
                let r = q(&release, vec![s(KEY), s(KEY), Val::I(hid)]).execute(&mut c)?;
                if t != 1 || r != 1 {
                    return Err(format!("cycle: {t} {r}").into());
                }
                n += 1;
            }
        }
        Db::Lite => {
            let mut c = sqlite_open(target, full)?;
            let take = format!(
                "UPDATE {k} SET holder = ?, token = token + 1 \
                 WHERE lock_key = ? AND holder IS NULL \
                 AND NOT EXISTS (SELECT 1 FROM {l} WHERE lock_key = ?) RETURNING token"
            );
            let release = lite_release_sql(prefix);
            while Instant::now() < end {
                hid += 1;
                q(&take, vec![Val::I(hid), s(KEY), s(KEY)]).get_result::<Token>(&mut c)?;
                if lite_release(&mut c, &release, hid)?.is_some() {
                    return Err("cycle: handed".into());
                }
                n += 1;
            }
        }
    }
    Ok(n as f64 / secs)
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[v.len() / 2]
}

fn pct(v: &mut [i64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_unstable();
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i] as f64 / 1000.0
}

/// Runs `variants` of `db`, interleaved, `rounds` times, and prints their rows.
fn measure(db: Db, target: &str, variants: &[&str], secs: f64, rounds: usize) -> Res<()> {
    let pid = std::process::id();
    let mut rates: HashMap<&str, Vec<f64>> = HashMap::new();
    let mut runs: HashMap<&str, Vec<Run>> = HashMap::new();
    let before = loadavg();
    let mut n = 0;
    for _ in 0..rounds {
        for &v in variants {
            n += 1;
            let prefix = format!("hf_{pid}_{n}");
            let full = v.contains('-');
            create(db, target, &prefix, full)?;
            let r = if v.starts_with("cycle") {
                cycle(db, target, &prefix, secs, full)
            } else {
                spawn_ring(db.name(), v, target, &prefix, secs).map(|r| {
                    rates.entry(v).or_default().push(r.rate);
                    let rate = r.rate;
                    runs.entry(v).or_default().push(r);
                    rate
                })
            };
            drop_tables(db, target, &prefix)?;
            let r = r?;
            if v.starts_with("cycle") {
                rates.entry(v).or_default().push(r);
            }
            eprintln!("{} {v}: {r:.0}/s", db.name());
        }
    }
    let after = loadavg();
    let cycle_of = |v: &str| {
        let c = match v.split_once('-') {
            Some((_, suffix)) => format!("cycle-{suffix}"),
            None => "cycle".to_owned(),
        };
        rates.get(c.as_str()).cloned()
    };
    let reference = match db {
        Db::Pg => rates.get("advisory").cloned(),
        Db::My => rates.get("getlock8").cloned(),
        Db::Lite => None,
    };
    println!("\n{} (load {before} → {after})", db.name());
    println!(
        "| variant | handoffs/s (runs) | fairness min/max | ÷ one-thread cycle | ÷ server lock queue | looks / handoff | fallbacks / retries (deadlock / busy) | commit→woke p50/p99 µs | release sent→held p50/p99 µs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for &v in variants {
        let r = &rates[v];
        let med = median(r.clone());
        let list = r
            .iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ");
        if v.starts_with("cycle") {
            println!(
                "| {v} (one process) | {med:.0} ({list}) cycles/s | – | 1 | – | – | – | – | – |"
            );
            continue;
        }
        let rs = &runs[v];
        let fair = rs
            .iter()
            .map(|x| format!("{}/{}", x.min, x.max))
            .collect::<Vec<_>>()
            .join(", ");
        let total: f64 = rs.iter().map(|x| x.rate * secs).sum();
        let looks = rs.iter().map(|x| x.looks).sum::<u64>() as f64 / total;
        let fallbacks: u64 = rs.iter().map(|x| x.fallbacks).sum();
        let retries: u64 = rs.iter().map(|x| x.retries).sum();
        let mut woke: Vec<i64> = rs.iter().flat_map(|x| x.lat.iter().map(|l| l.0)).collect();
        let mut held: Vec<i64> = rs.iter().flat_map(|x| x.lat.iter().map(|l| l.1)).collect();
        let ring = !(v == "advisory" || v == "getlock8");
        // Ratios within each round (the variants of a round ran one after the other), their
        // median first.
        let ratio = |d: Option<Vec<f64>>| {
            d.map_or("–".to_owned(), |d| {
                let each: Vec<f64> = r.iter().zip(&d).map(|(a, b)| a / b).collect();
                let list = each
                    .iter()
                    .map(|x| format!("{x:.2}"))
                    .collect::<Vec<_>>()
                    .join(", ");
                format!("{:.2} ({list})", median(each))
            })
        };
        println!(
            "| {v} | {med:.0} ({list}) | {fair} | {} | {} | {} | {} | {} | {} |",
            if ring {
                ratio(cycle_of(v))
            } else {
                "–".into()
            },
            ratio(reference.clone()),
            if ring {
                format!("{looks:.2}")
            } else {
                "–".into()
            },
            if ring {
                format!("{fallbacks} / {retries}")
            } else {
                "–".into()
            },
            if ring {
                format!("{:.0} / {:.0}", pct(&mut woke, 0.5), pct(&mut woke, 0.99))
            } else {
                "–".into()
            },
            if ring {
                format!("{:.0} / {:.0}", pct(&mut held, 0.5), pct(&mut held, 0.99))
            } else {
                "–".into()
            },
        );
    }
    Ok(())
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return child(&args[1..]);
    }
    let mut secs = 3.0;
    let mut rounds = 3;
    let mut pg = std::env::var("DLOCK_TEST_PG_URL").ok();
    let mut my = std::env::var("DLOCK_TEST_MYSQL_URL").ok();
    let mut lite = false;
    let mut only: Vec<String> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--secs" => secs = it.next().ok_or("--secs N")?.parse()?,
            "--rounds" => rounds = it.next().ok_or("--rounds N")?.parse()?,
            "--pg" => pg = Some(it.next().ok_or("--pg URL")?.clone()),
            "--mysql" => my = Some(it.next().ok_or("--mysql URL")?.clone()),
            "--sqlite" => lite = true,
            "--only" => only.push(it.next().ok_or("--only pg|mysql|sqlite")?.clone()),
            _ => return Err(format!("unknown argument {a}").into()),
        }
    }
    let wanted = |d: Db| only.is_empty() || only.iter().any(|o| o == d.name());
    if let (Some(url), true) = (&pg, wanted(Db::Pg)) {
        measure(
            Db::Pg,
            url,
            &["notify", "cycle", "advisory", "notify-async", "cycle-async"],
            secs,
            rounds,
        )?;
    }
    if let (Some(url), true) = (&my, wanted(Db::My)) {
        measure(
            Db::My,
            url,
            &[
                "poll0", "poll250", "poll1000", "getlock", "cycle", "getlock8",
            ],
            secs,
            rounds,
        )?;
    }
    if lite || (!only.is_empty() && wanted(Db::Lite)) {
        let dir = std::env::temp_dir().join(format!("handover_floor_{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let path = dir.join("locks.db");
        let path = path.to_str().ok_or("path")?.to_owned();
        let r = measure(
            Db::Lite,
            &path,
            &[
                "poll0",
                "poll250",
                "poll1000",
                "bell",
                "cycle",
                "bell-full",
                "cycle-full",
            ],
            secs,
            rounds,
        );
        let _ = std::fs::remove_dir_all(&dir);
        r?;
    }
    Ok(())
}
