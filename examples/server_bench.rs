//! Cycles/s of one uncontended acquire + release for `ForUpdate` and `Advisory`, beside the
//! raw floor: the same statements issued directly through diesel (typed, so cached as
//! prepared statements) on the same pool, interleaved round by round so that the drift of a
//! shared machine cancels (see BENCHMARKS.md). Also the cost of the advisory fencing token:
//! the raw lock + unlock with and without the token statement(s).
//!
//! ```text
//! eval "$(../shared/services.sh)"
//! cargo run --release --example server_bench --features postgres,mysql
//! ```

use diesel::prelude::*;
use diesel::r2d2::{ConnectionManager, Pool};
use diesel::sql_types::{BigInt, Integer, Text};
use diesel_lock::{LockConnection, Locker, Strategy};
use std::time::{Duration, Instant};

diesel::table! {
    dlock_for_update (lock_key) {
        lock_key -> Text,
        version -> BigInt,
    }
}

diesel::table! {
    dlock_tokens (lock_key) {
        lock_key -> Text,
        token -> BigInt,
    }
}

diesel::define_sql_function! { fn pg_try_advisory_lock(key: BigInt) -> Bool; }
diesel::define_sql_function! { fn pg_advisory_unlock(key: BigInt) -> Bool; }
diesel::define_sql_function! { #[sql_name = "GET_LOCK"] fn get_lock(name: Text, timeout: Integer) -> Nullable<Integer>; }
diesel::define_sql_function! { #[sql_name = "RELEASE_LOCK"] fn release_lock(name: Text) -> Nullable<Integer>; }
diesel::define_sql_function! { #[sql_name = "LAST_INSERT_ID"] fn last_insert_id() -> BigInt; }
diesel::define_sql_function! { #[sql_name = "LAST_INSERT_ID"] fn set_last_insert_id(v: BigInt) -> BigInt; }

const ROUND: Duration = Duration::from_millis(300);
const ROUNDS: usize = 7;

/// Cycles per second of `cycle`, run for one round.
fn rate(mut cycle: impl FnMut()) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < ROUND {
        cycle();
        n += 1;
    }
    n as f64 / start.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the contestants round-robin, `ROUNDS` times, and returns each one's median.
fn interleaved(contestants: &mut [&mut dyn FnMut()]) -> Vec<f64> {
    for c in contestants.iter_mut() {
        rate(c); // warm-up: connections, prepared statements, rows
    }
    let mut rates = vec![Vec::new(); contestants.len()];
    for _ in 0..ROUNDS {
        for (c, r) in contestants.iter_mut().zip(&mut rates) {
            r.push(rate(&mut *c));
        }
    }
    rates.into_iter().map(median).collect()
}

fn report(what: &str, names: &[&str], rates: &[f64]) {
    let floor = rates[1];
    for (name, r) in names.iter().zip(rates) {
        println!(
            "{what:<28} {name:<34} {r:>8.0} cycles/s  {:>5.2} × raw",
            r / floor
        );
    }
}

fn pool<C: LockConnection>(url: &str) -> Pool<ConnectionManager<C>> {
    Pool::builder()
        .max_size(4)
        .min_idle(Some(0))
        .build(ConnectionManager::new(url))
        .expect("pool")
}

fn lockers<C: LockConnection>(pool: &Pool<ConnectionManager<C>>) -> (Locker<C>, Locker<C>) {
    let build = |s| Locker::builder(pool.clone()).strategy(s).build().unwrap();
    let (f, a) = (build(Strategy::ForUpdate), build(Strategy::Advisory));
    f.migrate().unwrap();
    (f, a)
}

fn postgres(url: &str) {
    let url = if url.contains("sslmode") {
        url.to_owned()
    } else {
        format!("{url}?sslmode=disable")
    };
    let pool = pool::<PgConnection>(&url);
    let (for_update, advisory) = lockers(&pool);
    let key = format!("bench-{}", std::process::id());
    let hash = diesel_lock::key_hash(&key);
    for_update.lock(&key).unwrap().release().unwrap(); // creates the row

    let rates = interleaved(&mut [
        &mut || for_update.lock(&key).unwrap().release().unwrap(),
        &mut || {
            let mut c = pool.get().unwrap();
            c.transaction(|c| {
                dlock_for_update::table
                    .filter(dlock_for_update::lock_key.eq(&key))
                    .select(dlock_for_update::version)
                    .for_update()
                    .get_result::<i64>(c)
            })
            .unwrap();
        },
    ]);
    report(
        "pg for-update",
        &[
            "Strategy::ForUpdate lock+release",
            "raw BEGIN/FOR UPDATE/COMMIT",
        ],
        &rates,
    );

    let rates = interleaved(&mut [
        &mut || advisory.lock(&key).unwrap().release().unwrap(),
        &mut || {
            let mut c = pool.get().unwrap();
            assert!(diesel::select(pg_try_advisory_lock(hash))
                .get_result::<bool>(&mut c)
                .unwrap());
            assert!(diesel::select(pg_advisory_unlock(hash))
                .get_result::<bool>(&mut c)
                .unwrap());
        },
        &mut || {
            let mut c = pool.get().unwrap();
            assert!(diesel::select(pg_try_advisory_lock(hash))
                .get_result::<bool>(&mut c)
                .unwrap());
            // The DSL is cached like the library's statements, so the floors compare alike.
            diesel::insert_into(dlock_tokens::table)
                .values((dlock_tokens::lock_key.eq(&key), dlock_tokens::token.eq(1)))
                .on_conflict(dlock_tokens::lock_key)
                .do_update()
                .set(dlock_tokens::token.eq(dlock_tokens::token + 1))
                .execute(&mut c)
                .unwrap();
            assert!(diesel::select(pg_advisory_unlock(hash))
                .get_result::<bool>(&mut c)
                .unwrap());
        },
    ]);
    report(
        "pg advisory",
        &[
            "Strategy::Advisory lock+release",
            "raw lock+unlock",
            "raw lock+token upsert+unlock",
        ],
        &rates,
    );
}

fn mysql(url: &str) {
    let pool = pool::<MysqlConnection>(url);
    let (for_update, advisory) = lockers(&pool);
    let key = format!("bench-{}", std::process::id());
    for_update.lock(&key).unwrap().release().unwrap();

    let rates = interleaved(&mut [
        &mut || for_update.lock(&key).unwrap().release().unwrap(),
        &mut || {
            let mut c = pool.get().unwrap();
            c.transaction(|c| {
                dlock_for_update::table
                    .filter(dlock_for_update::lock_key.eq(&key))
                    .select(dlock_for_update::version)
                    .for_update()
                    .get_result::<i64>(c)
            })
            .unwrap();
        },
    ]);
    report(
        "mariadb for-update",
        &[
            "Strategy::ForUpdate lock+release",
            "raw BEGIN/FOR UPDATE/COMMIT",
        ],
        &rates,
    );

    let rates = interleaved(&mut [
        &mut || advisory.lock(&key).unwrap().release().unwrap(),
        &mut || {
            let mut c = pool.get().unwrap();
            assert_eq!(
                diesel::select(get_lock(&key, 0))
                    .get_result::<Option<i32>>(&mut c)
                    .unwrap(),
                Some(1)
            );
            assert_eq!(
                diesel::select(release_lock(&key))
                    .get_result::<Option<i32>>(&mut c)
                    .unwrap(),
                Some(1)
            );
        },
        &mut || {
            let mut c = pool.get().unwrap();
            assert_eq!(
                diesel::select(get_lock(&key, 0))
                    .get_result::<Option<i32>>(&mut c)
                    .unwrap(),
                Some(1)
            );
            diesel::insert_into(dlock_tokens::table)
                .values((
                    dlock_tokens::lock_key.eq(&key),
                    dlock_tokens::token.eq(set_last_insert_id(1)),
                ))
                .on_conflict(diesel::dsl::DuplicatedKeys)
                .do_update()
                .set(dlock_tokens::token.eq(set_last_insert_id(dlock_tokens::token + 1)))
                .execute(&mut c)
                .unwrap();
            diesel::select(last_insert_id())
                .get_result::<i64>(&mut c)
                .unwrap();
            assert_eq!(
                diesel::select(release_lock(&key))
                    .get_result::<Option<i32>>(&mut c)
                    .unwrap(),
                Some(1)
            );
        },
    ]);
    report(
        "mariadb advisory",
        &[
            "Strategy::Advisory lock+release",
            "raw GET_LOCK+RELEASE_LOCK",
            "raw GET_LOCK+token+RELEASE_LOCK",
        ],
        &rates,
    );
}

fn main() {
    println!("one uncontended acquire + release, 1 thread, median of {ROUNDS} interleaved rounds of {ROUND:?}");
    match std::env::var("DLOCK_TEST_PG_URL") {
        Ok(url) => postgres(&url),
        Err(_) => println!("DLOCK_TEST_PG_URL is not set: PostgreSQL skipped"),
    }
    match std::env::var("DLOCK_TEST_MYSQL_URL") {
        Ok(url) => mysql(&url),
        Err(_) => println!("DLOCK_TEST_MYSQL_URL is not set: MySQL skipped"),
    }
}
