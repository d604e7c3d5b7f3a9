//! A count of the holders of a key kept in a table of its own, which every holder bumps on
//! entering and lowers on leaving: what each holder reads on entering says how many hold the
//! key beside it (shared locks, semaphores).

use super::conformance::TestDb;
use diesel::connection::SimpleConnection;
use diesel::sql_types::{BigInt, Text};
use diesel::{Connection, QueryableByName, RunQueryDsl};

#[derive(QueryableByName, Debug, Clone, Copy)]
pub struct Occupants {
    /// Holders now, this one included.
    #[diesel(sql_type = BigInt)]
    pub holders: i64,
    /// Writers among them.
    #[diesel(sql_type = BigInt)]
    pub writers: i64,
}

pub trait Occupancy: TestDb {
    /// Creates the table if needed and the row of `name`.
    fn occupancy_init(&mut self, name: &str);
    /// Enters (a writer or not) and returns who is there now.
    fn enter(&mut self, name: &str, writer: bool) -> Occupants;
    fn leave(&mut self, name: &str, writer: bool);
}

macro_rules! occupancy {
    ($conn:ty, $ph:expr) => {
        impl Occupancy for $conn {
            fn occupancy_init(&mut self, name: &str) {
                let ph: fn(usize) -> String = $ph;
                self.batch_execute(
                    "CREATE TABLE IF NOT EXISTS dlock_test_occupancy (
                        name VARCHAR(255) PRIMARY KEY,
                        holders BIGINT NOT NULL,
                        writers BIGINT NOT NULL)",
                )
                .expect("create occupancy table");
                diesel::sql_query(format!(
                    "INSERT INTO dlock_test_occupancy (name, holders, writers) VALUES ({}, 0, 0)",
                    ph(1)
                ))
                .bind::<Text, _>(name)
                .execute(self)
                .expect("init occupancy");
            }

            fn enter(&mut self, name: &str, writer: bool) -> Occupants {
                let ph: fn(usize) -> String = $ph;
                self.transaction(|c| {
                    diesel::sql_query(format!(
                        "UPDATE dlock_test_occupancy SET holders = holders + 1, \
                         writers = writers + {} WHERE name = {}",
                        ph(1),
                        ph(2)
                    ))
                    .bind::<BigInt, _>(i64::from(writer))
                    .bind::<Text, _>(name)
                    .execute(c)?;
                    diesel::sql_query(format!(
                        "SELECT holders, writers FROM dlock_test_occupancy WHERE name = {}",
                        ph(1)
                    ))
                    .bind::<Text, _>(name)
                    .get_result::<Occupants>(c)
                })
                .expect("enter")
            }

            fn leave(&mut self, name: &str, writer: bool) {
                let ph: fn(usize) -> String = $ph;
                diesel::sql_query(format!(
                    "UPDATE dlock_test_occupancy SET holders = holders - 1, \
                     writers = writers - {} WHERE name = {}",
                    ph(1),
                    ph(2)
                ))
                .bind::<BigInt, _>(i64::from(writer))
                .bind::<Text, _>(name)
                .execute(self)
                .expect("leave");
            }
        }
    };
}

occupancy!(diesel::SqliteConnection, |_| "?".to_owned());
#[cfg(feature = "postgres")]
occupancy!(diesel::PgConnection, |n| format!("${n}"));
#[cfg(feature = "mysql")]
occupancy!(diesel::MysqlConnection, |_| "?".to_owned());

/// `threads` × `rounds` permits of the semaphore `key` (of `permits`) taken through `locker`,
/// each holder checking the count of holders (never more than `permits`) and that its
/// thread's tokens increase; the largest count seen.
#[allow(dead_code)] // not every test binary counts permits
pub fn count_permit_holders<C: Occupancy>(
    pool: &diesel::r2d2::Pool<diesel::r2d2::ConnectionManager<C>>,
    locker: &diesel_lock::Locker<C>,
    key: &str,
    permits: u32,
    threads: usize,
    rounds: usize,
) -> i64 {
    use std::sync::atomic::{AtomicI64, Ordering};
    use std::sync::{Arc, Barrier};
    let max = Arc::new(AtomicI64::new(0));
    let start = Arc::new(Barrier::new(threads));
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (locker, pool, key) = (locker.clone(), pool.clone(), key.to_owned());
            let (max, start) = (max.clone(), start.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut last_token = 0;
                for _ in 0..rounds {
                    let g = locker.permit(&key, permits).unwrap();
                    assert!(g.token() > last_token, "tokens of a key increase");
                    last_token = g.token();
                    let mut c = pool.get().unwrap();
                    let seen = c.enter(&key, false);
                    assert!(
                        seen.holders <= i64::from(permits),
                        "{} holders of a semaphore of {permits}",
                        seen.holders
                    );
                    max.fetch_max(seen.holders, Ordering::Relaxed);
                    std::thread::sleep(std::time::Duration::from_micros(500));
                    c.leave(&key, false);
                    drop(c);
                    g.release().unwrap();
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().unwrap();
    }
    max.load(Ordering::Relaxed)
}
