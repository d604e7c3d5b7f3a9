//! Distributed locks kept in the database you already run.
//!
//! `diesel-lock` gives synchronous Rust programs locks that exclude each other across threads,
//! processes and machines, stored in PostgreSQL, MySQL/MariaDB or SQLite (the embedded
//! default) through Diesel and an r2d2 pool. Every lock is held by an RAII guard:
//!
//! ```
//! use diesel_lock::{Locker, Strategy};
//! use std::time::Duration;
//!
//! # fn main() -> diesel_lock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let path = dir.path().join("locks.db");
//! # let url = path.to_str().unwrap();
//! // `url` is a file path here (SQLite); postgres:// and mysql:// URLs work the same way.
//! let locker = Locker::connect(url)?
//!     .strategy(Strategy::Lease { ttl: Duration::from_secs(30) })
//!     .build()?;
//! locker.migrate()?; // creates the tables once; safe to call at every start
//!
//! {
//!     let guard = locker.lock("nightly-report")?;
//!     println!("running with fencing token {}", guard.token());
//!     // ... work that must not run twice at once ...
//! } // released here
//!
//! match locker.try_lock_for("nightly-report", Duration::from_millis(100))? {
//!     Some(guard) => guard.release()?, // release() reports errors; Drop can only log them
//!     None => println!("someone else is running it"),
//! }
//! # Ok(()) }
//! ```
//!
//! # Strategies
//! One [`LockGuard`] type serves every [`Strategy`]:
//!
//! - [`Strategy::Lease`] (the default, ttl 30 s): a holder id and an expiry computed by the
//!   database clock. A heartbeat renews the lease every ttl/3 while the guard lives; a holder
//!   that crashes or is paused past its ttl loses the lock, and [`LockGuard::check`] says so.
//! - [`Strategy::Row`]: a row inserted on a unique key and deleted by id on release. A crashed
//!   holder's row stays until `stale_after` lets another taker delete it (or forever without).
//! - [`Strategy::ForUpdate`] (PostgreSQL, MySQL): the key's row locked by `SELECT … FOR
//!   UPDATE` in a transaction the guard keeps open; release is `COMMIT`.
//! - [`Strategy::Advisory`] (PostgreSQL `pg_advisory_lock`, MySQL `GET_LOCK`): a lock held
//!   by a database session; the guards of one `Locker` share a few sessions (at most half
//!   the pool, 4 at most), so 10⁴ locks fit on a pool of 8.
//! - [`Strategy::AdvisoryXact`] (PostgreSQL `pg_advisory_xact_lock`): the same lock held by
//!   a transaction the guard keeps open; release is `COMMIT`. What works behind a
//!   transaction-pooling PgBouncer (with `dlock_pooler=transaction` in the URL given to
//!   [`Locker::connect`]; docs/guide.md, "Behind a connection pooler"), where `Advisory`
//!   does not.
//!
//! The last three are *session strategies*: the lock lives in a database session, waiting
//! happens in the server's lock queue, and a holder that dies frees its lock
//! as soon as the server sees its connection close, with no ttl to wait out. A failover
//! ends the lock with the session, and so does a network partition once the server's TCP
//! keepalives give up on the holder (2 h 11 min by Linux's defaults: see docs/guide.md for
//! settings that make it 25 s); [`LockGuard::check`] asks the server on the guard's own
//! connection and reports [`Error::LockLost`]. A `Lease` guard cut off from the database
//! reports the loss by itself, before any other client can take the key. A `ForUpdate` or
//! `AdvisoryXact` guard owns a pooled connection, with its open transaction, for its whole
//! life (a lock per transaction, by nature): size the pool for the locks held at once. An
//! `Advisory` guard shares its session with the `Locker`'s other guards (a lock won by a
//! wait keeps the session it waited on when the shared ones are all open); when a shared
//! session ends, every guard on it reports the loss. See [`Strategy`] for the details of
//! each. SQLite has none of them, and refuses them with
//! [`Error::Unsupported`] (MySQL refuses `AdvisoryXact`).
//!
//! A session lock lives as long as its connection is open in *any* process. The MySQL/MariaDB
//! client library opens its sockets without close-on-exec (libpq and SQLite set it), so a
//! process spawned while a MySQL guard is held inherits the socket, and it, or a background
//! job of it, keeps the lock after your process has died (until they end, or the server's
//! `wait_timeout`). Before spawning, mark descriptors above 2 close-on-exec in
//! `std::os::unix::process::CommandExt::pre_exec` (Linux 5.11+: `close_range(3, !0,
//! CLOSE_RANGE_CLOEXEC)`; else `fcntl(fd, F_SETFD, FD_CLOEXEC)` on each), as `dlock run` does.
//!
//! # Losing a lock, leaders, metrics
//! A guard tells when its lock is lost without being asked: [`LockGuard::wait_lost`],
//! [`LockGuard::on_lost`] and [`LockGuard::loss_watch`] (a [`LossWatch`] handle for other
//! threads), never after a normal release (see `loss_watch` for how soon each strategy
//! tells). [`Election`] runs "one of N replicas leads" on a lock, its term being the lock's
//! fencing token. With the `metrics` feature the library records acquisitions, contention,
//! time waited and held, locks held, losses and release failures through the
//! [`metrics`](https://docs.rs/metrics) facade, labelled by strategy and backend.
//!
//! Without any lock, [`optimistic::transaction`] runs read-modify-write work in a
//! transaction that commits only if the key's version did not change meanwhile.
//!
//! # Guarantees
//! - **Mutual exclusion** per key and strategy, as long as the database keeps its own
//!   promises (a committed row is visible to every later statement).
//! - **Fencing tokens**: [`LockGuard::token`] strictly increases per key, so a resource can
//!   refuse a holder whose lock has lapsed. `Row` and `Lease` count per key; `ForUpdate` and
//!   `Advisory` draw from one global source, so their tokens skip the values other keys took
//!   (see [`Strategy`]).
//! - **Time from the database**: expiries and staleness are computed by the server's clock,
//!   never the client's.
//! - **No lock blocks forever after a crash**, except a `Row` lock without `stale_after`,
//!   which is documented as such.
//! - **Tokens survive their holder, the server, and a failover**: a token drawn by a holder
//!   that then crashed is never issued again, nor is one handed out before a crash of the
//!   database server, nor one handed out before a promotion of a standby, even one that
//!   lagged: tokens carry the server's epoch (PostgreSQL's timeline, MySQL's clock; the
//!   repository's `docs/replication.md` has the bounds and what holds per topology).
//!
//! Keys are 1 to 255 bytes of UTF-8 without NUL, compared exactly (case-sensitive) on every
//! backend; anything else is [`Error::InvalidKey`] before any SQL runs. Locks are not
//! reentrant unless the `Locker` is built with [`LockerBuilder::reentrant`].
//!
//! # More kinds of lock
//! - **Readers and writers**: [`Locker::read`] / [`Locker::write`] (and `try_` / `_for`
//!   forms): many readers or one writer per key; a waiting writer keeps new readers out, so
//!   writers do not starve.
//! - **Semaphores**: [`Locker::permit`]`(key, n)`: at most `n` holders per key, `n` fixed by
//!   the key's first acquisition ([`Error::Permits`] otherwise).
//! - **One lock per key**: the writer is the key's exclusive lock ([`Locker::lock`]), which
//!   excludes the key's readers and permit holders and which they exclude, on every
//!   strategy. A key is a reader-writer lock or a semaphore, never both ([`Error::Permits`]).
//! - **Several keys at once**: [`Locker::lock_all`] takes keys in byte order, all or
//!   nothing, so callers naming them in different orders cannot deadlock ([`MultiGuard`]).
//!
//! Readers, writers and permits work with `Lease` on every backend: each holder is a lease
//! of its own (a crashed holder's share returns after its ttl), with a fencing token that
//! strictly increases per key. `ForUpdate` (PostgreSQL, MySQL) has readers and writers
//! (`FOR SHARE` beside `FOR UPDATE`) and semaphores (a slot row per permit, beside the key's
//! row `FOR SHARE`); `Advisory` on PostgreSQL has readers and writers
//! (`pg_advisory_lock_shared`) and semaphores (an advisory lock per permit, beside the key's
//! shared one): their holders' shares return when their sessions end. `Advisory` on MySQL
//! (`GET_LOCK` has no shared mode) refuses both ([`Error::Unsupported`],
//! [`Error::Incompatible`]), and so do `Row` and `AdvisoryXact` ([`Error::Unsupported`]).
//!
//! # Backends
//! Features `sqlite` (default, compiled in), `postgres` and `mysql` (link the system's
//! `libpq` and `libmysqlclient`), `cli` for the `dlock` binary, and `metrics` (above).
//! [`Locker::connect`] builds the `Locker`'s own pool of [`AnyConnection`] from a URL and
//! keeps the URL (to listen for releases on PostgreSQL, and to say why a connection failed:
//! [`Error::Connection`] with a [`ConnectFailure`]); size it with
//! [`LockerBuilder::pool_size`] or `dlock_pool_size=N` in the URL (default 10).
//! [`Locker::builder`] takes a pool of yours instead: one from [`connect`], or of a concrete
//! diesel connection. For SQLite pools you build yourself, add [`SqliteTuning`] as the
//! connection customizer (`build` refuses a SQLite pool without WAL and a busy timeout).
//!
//! # Your own queries
//! [`Locker::pool`] lends the `Locker`'s pool to the application. Its connections are
//! [`AnyConnection`]s, diesel `MultiConnection`s: diesel's query builder works on them, but a
//! raw `sql_query` is sent as written, and its bind placeholders differ per database (`?` on
//! SQLite and MySQL, `$1` on PostgreSQL), so one text cannot serve every backend. Match the
//! connection to reach the concrete one:
//!
//! ```
//! use diesel::connection::SimpleConnection;
//! use diesel::sql_types::{Integer, Text};
//! use diesel::RunQueryDsl;
//! use diesel_lock::{AnyConnection, Locker};
//!
//! # fn main() -> diesel_lock::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let url = dir.path().join("app.db").display().to_string();
//! let locker = Locker::connect(&url)?.build()?;
//! locker.migrate()?;
//! let mut conn = locker.pool().get()?;
//! conn.batch_execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, state TEXT NOT NULL)")?;
//! let inserted = match &mut *conn {
//!     AnyConnection::Sqlite(c) => diesel::sql_query("INSERT INTO jobs VALUES (?, ?)")
//!         .bind::<Integer, _>(1)
//!         .bind::<Text, _>("queued")
//!         .execute(c)?,
//!     # #[allow(unreachable_patterns)]
//!     _ => unreachable!("this example opened a SQLite file"),
//! };
//! assert_eq!(inserted, 1);
//! # Ok(()) }
//! ```
//!
//! Or keep a pool of the concrete type beside the `Locker` (or under it), and write the
//! queries for that database (a `Locker` over a pool of yours listens for releases on
//! PostgreSQL only when given [`LockerBuilder::listen_url`]):
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use diesel::r2d2::{ConnectionManager, Pool};
//! use diesel::sql_types::Integer;
//! use diesel::{PgConnection, RunQueryDsl};
//! use diesel_lock::Locker;
//!
//! let url = "postgres://app:secret@db/app";
//! let pool: Pool<ConnectionManager<PgConnection>> =
//!     Pool::builder().max_size(16).build(ConnectionManager::new(url))?;
//! let locker = Locker::builder(pool.clone()).listen_url(url).build()?;
//! let _guard = locker.lock("invoices")?;
//! diesel::sql_query("UPDATE jobs SET state = 'running' WHERE id = $1")
//!     .bind::<Integer, _>(7)
//!     .execute(&mut *pool.get()?)?;
//! # Ok(()) }
//! # #[cfg(not(feature = "postgres"))]
//! # fn main() {}
//! ```

#![deny(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

pub mod admin;
mod backend;
mod backoff;
mod election;
mod error;
mod guard;
mod hold;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub mod hooks;
mod instrument;
mod key;
mod lock_info;
mod locker;
mod loss;
pub mod optimistic;
mod random;
mod strategy;
mod sync;
#[cfg(test)]
mod test_env;
mod watcher;

#[cfg(feature = "sqlite")]
pub use backend::SqliteTuning;
pub use backend::{connect, mask_secrets, AnyConnection, Backend, LockConnection};
pub use election::{Election, Leadership, Term};
pub use error::{ConnectFailure, Error, Result};
pub use guard::LockGuard;
pub use key::{key_hash, MAX_KEY_LEN};
pub use lock_info::{LockInfo, LockMode, StrategyKind};
pub use locker::{Cancel, Locker, LockerBuilder, MultiGuard};
pub use loss::{LockStatus, LossWatch};
pub use strategy::Strategy;

#[cfg(feature = "bench-sql")]
#[doc(hidden)]
pub use backend::bench_sql as __bench_sql;
#[cfg(feature = "test-hooks")]
#[doc(hidden)]
pub use hooks as __test_hooks;
#[doc(hidden)]
pub use instrument::renewal_statements as __renewal_statements;
