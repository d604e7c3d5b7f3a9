//! Optimistic read-merge-write: 8 threads add entries to one JSON-ish list kept in a text
//! field, with no lock held; a writer that lost a race rolls back and merges again.
//!
//! `cargo run --example optimistic [DATABASE_URL]` (default: a SQLite file in a temp dir).

use diesel::connection::SimpleConnection;
use diesel::sql_types::Text;
use diesel::{QueryableByName, RunQueryDsl};
use diesel_lock::{optimistic, AnyConnection, Backend, Locker};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

#[derive(QueryableByName)]
struct Doc {
    #[diesel(sql_type = Text)]
    body: String,
}

fn read(c: &mut AnyConnection) -> diesel::QueryResult<String> {
    diesel::sql_query("SELECT body FROM example_docs WHERE name = 'list'")
        .get_result::<Doc>(c)
        .map(|d| d.body)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::temp_dir().join(format!("dlock-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let default_url = dir.join("example.db").to_string_lossy().into_owned();
    let url = std::env::args().nth(1).unwrap_or(default_url);

    let pool = diesel_lock::connect(&url)?;
    let locker = Locker::builder(pool.clone()).build()?;
    locker.migrate()?;
    // sql_query passes its text through as it is, so it is written in the backend's own
    // placeholder style.
    let update: &'static str = match locker.backend() {
        Backend::Postgres => "UPDATE example_docs SET body = $1 WHERE name = 'list'",
        _ => "UPDATE example_docs SET body = ? WHERE name = 'list'",
    };
    pool.get()?.batch_execute(
        "DROP TABLE IF EXISTS example_docs;
         CREATE TABLE example_docs (name VARCHAR(64) PRIMARY KEY, body TEXT NOT NULL);
         INSERT INTO example_docs (name, body) VALUES ('list', '[]');",
    )?;

    let retries = Arc::new(AtomicU32::new(0));
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (pool, retries) = (pool.clone(), retries.clone());
            std::thread::spawn(move || -> diesel_lock::Result<()> {
                let mut conn = pool.get()?;
                for n in 0..25 {
                    let mut runs = 0;
                    optimistic::transaction(&mut *conn, "example/list", 1000, |c, _version| {
                        runs += 1;
                        let body = read(c)?;
                        let entry = format!("\"{t}.{n}\"");
                        let merged = match body.as_str() {
                            "[]" => format!("[{entry}]"),
                            _ => format!("{},{entry}]", body.trim_end_matches(']')),
                        };
                        diesel::sql_query(update).bind::<Text, _>(merged).execute(c)
                    })?;
                    retries.fetch_add(runs - 1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("writer panicked")?;
    }

    let body = read(&mut *pool.get()?)?;
    let entries = body.trim_matches(['[', ']']).split(',').count();
    println!(
        "{entries} entries (expected 200), {} attempts rolled back and merged again",
        retries.load(Ordering::Relaxed)
    );
    assert_eq!(entries, 200, "an update was lost");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
