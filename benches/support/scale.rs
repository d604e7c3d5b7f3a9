//! Scale fixtures: the lock tables filled with 10³ or 10⁶ rows of other keys (stale `Row`
//! rows two hours old, free `Lease` rows last taken two hours ago), and acquire latency.

use super::{Cycle, Db};
use diesel::connection::SimpleConnection;
use diesel::Connection;
use diesel_lock::Strategy;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The strategies whose tables grow with the number of keys, and what `purge` removes.
pub fn strategies() -> [Strategy; 2] {
    [
        // stale_after makes the filled rows purgeable (they are two hours old).
        Strategy::Row {
            stale_after: Some(Duration::from_secs(3600)),
        },
        Strategy::Lease { ttl: super::TTL },
    ]
}

fn execute(db: Db, sql: &str) {
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql")),
        allow(unused_variables)
    )]
    let url = super::url(db).expect("url");
    let r = match db {
        #[cfg(feature = "postgres")]
        Db::Postgres => diesel::PgConnection::establish(&url)
            .expect("connect")
            .batch_execute(sql),
        #[cfg(feature = "mysql")]
        Db::Mysql => diesel::MysqlConnection::establish(&url)
            .expect("connect")
            .batch_execute(sql),
        #[cfg(feature = "sqlite")]
        Db::Sqlite => {
            let mut c = diesel::SqliteConnection::establish(super::sqlite_path()).expect("open");
            c.batch_execute("PRAGMA busy_timeout = 30000;").unwrap();
            c.batch_execute(sql)
        }
        #[allow(unreachable_patterns)]
        _ => unreachable!(),
    };
    r.unwrap_or_else(|e| panic!("{e}: {sql}"));
}

/// 0 .. 10^digits - 1, in SQL every backend reads: a cross join of digit tables.
fn numbers(digits: u32) -> String {
    let d = "(SELECT 0 AS d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 \
             UNION ALL SELECT 4 UNION ALL SELECT 5 UNION ALL SELECT 6 UNION ALL SELECT 7 \
             UNION ALL SELECT 8 UNION ALL SELECT 9)";
    let from: Vec<String> = (0..digits).map(|i| format!("{d} d{i}")).collect();
    let value: Vec<String> = (0..digits)
        .map(|i| format!("d{i}.d * {}", 10u64.pow(i)))
        .collect();
    format!("SELECT {} AS n FROM {}", value.join(" + "), from.join(", "))
}

/// Fills `dlock_rows` and `dlock_leases` with 10^digits rows of keys `fill-<n>` (those
/// already there are kept).
pub fn fill(db: Db, digits: u32) {
    let nums = numbers(digits);
    let sql = match db {
        Db::Postgres => format!(
            "INSERT INTO dlock_rows (lock_key, owner, token, acquired_at, stale_at) \
               SELECT 'fill-' || n, 'fill', 1, now() - interval '2 hours', \
                      now() - interval '1 hour' FROM ({nums}) s \
               ON CONFLICT DO NOTHING; \
             INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
               SELECT 'fill-' || n, 'fill', NULL, 5, now() - interval '2 hours', NULL \
               FROM ({nums}) s ON CONFLICT DO NOTHING; \
             ANALYZE dlock_rows; ANALYZE dlock_leases;"
        ),
        Db::Mysql => format!(
            "INSERT IGNORE INTO dlock_rows (lock_key, owner, token, acquired_at, stale_at) \
               SELECT CONCAT('fill-', n), 'fill', 0, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, \
                      UTC_TIMESTAMP(6) - INTERVAL 1 HOUR FROM ({nums}) s; \
             INSERT IGNORE INTO dlock_leases \
               (lock_key, owner, holder_id, token, acquired_at, expires_at) \
               SELECT CONCAT('fill-', n), 'fill', NULL, 5, UTC_TIMESTAMP(6) - INTERVAL 2 HOUR, \
                      NULL FROM ({nums}) s; \
             ANALYZE TABLE dlock_rows, dlock_leases;"
        ),
        Db::Sqlite => format!(
            "INSERT INTO dlock_rows (lock_key, owner, token, acquired_at, stale_at) \
               SELECT 'fill-' || n, 'fill', 1, strftime('%Y-%m-%d %H:%M:%f', 'now', '-2 hours'), \
                      strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 hours') \
               FROM ({nums}) s WHERE true ON CONFLICT DO NOTHING; \
             INSERT INTO dlock_leases (lock_key, owner, holder_id, token, acquired_at, expires_at) \
               SELECT 'fill-' || n, 'fill', NULL, 5, \
                      strftime('%Y-%m-%d %H:%M:%f', 'now', '-2 hours'), NULL \
               FROM ({nums}) s WHERE true ON CONFLICT DO NOTHING;"
        ),
    };
    execute(db, &sql);
}

/// Removes what the fills and purges left: the `fill-` rows and their saved tokens.
pub fn cleanup(db: Db) {
    execute(
        db,
        "DELETE FROM dlock_rows WHERE lock_key LIKE 'fill-%'; \
         DELETE FROM dlock_leases WHERE lock_key LIKE 'fill-%'; \
         DELETE FROM dlock_tokens WHERE lock_key LIKE 'fill-%';",
    );
}

/// Latencies of `samples` acquisitions of `key` (each released before the next, outside
/// the timing).
pub fn acquire_latencies(l: &Arc<dyn Cycle>, key: &str, samples: usize) -> Vec<Duration> {
    (0..samples)
        .map(|_| {
            let t = Instant::now();
            let release = l.acquire(key);
            let d = t.elapsed();
            release();
            d
        })
        .collect()
}

pub fn p50(v: &[Duration]) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v[v.len() / 2]
}
