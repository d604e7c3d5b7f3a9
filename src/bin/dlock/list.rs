//! `dlock list` and `dlock status`: the held locks read from the database and printed as a
//! table, as JSON or as one line per holder; and `output`, which writes to stdout.

use crate::args::{round_ms, Failure};
use crate::database::Database;
use diesel_lock::{admin, Error, LockInfo};
use std::io::{self, Write};
use std::time::Duration;

/// The held locks, of every key or of one; a database without the tables holds none.
fn held_locks(db: &Database, key: Option<&str>) -> Result<Vec<LockInfo>, Failure> {
    let pool = db.connect()?;
    let mut conn = pool.get().map_err(Error::from)?;
    let result = match key {
        None => admin::held_locks(&mut *conn),
        Some(key) => admin::lock_info(&mut *conn, key),
    };
    match result {
        Ok(v) => Ok(v),
        Err(Error::MissingTable(_)) => Ok(Vec::new()),
        Err(e) => Err(e.into()),
    }
}

fn time(t: chrono::DateTime<chrono::Utc>) -> String {
    t.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

fn age(d: Duration) -> String {
    let d = if d >= Duration::from_secs(1) {
        Duration::from_secs(d.as_secs())
    } else {
        round_ms(d)
    };
    humantime::format_duration(d).to_string()
}

/// Writes to stdout; a closed pipe (`dlock list | head`) is not an error.
pub(crate) fn output(text: &str) -> Result<(), Failure> {
    match io::stdout().lock().write_all(text.as_bytes()) {
        Err(e) if e.kind() != io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

pub(crate) fn list(db: &Database, json: bool) -> Result<u8, Failure> {
    let held = held_locks(db, None)?;
    if json {
        let rows: Vec<serde_json::Value> = held
            .iter()
            .map(|i| {
                serde_json::json!({
                    "key": i.key,
                    "strategy": i.strategy.as_str(),
                    "mode": i.mode.as_str(),
                    "permits": i.permits,
                    "owner": i.owner,
                    "token": i.token,
                    "acquired_at": i.acquired_at.to_rfc3339_opts(chrono::SecondsFormat::Micros, true),
                    "expires_at": i.expires_at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
                    "age_seconds": i.age().as_secs_f64(),
                    "waiting": i.waiting,
                    "longest_wait_seconds": i.longest_wait.map(|w| w.as_secs_f64()),
                })
            })
            .collect();
        let text =
            serde_json::to_string_pretty(&rows).map_err(|e| Failure::new(1, e.to_string()))?;
        return output(&format!("{text}\n")).map(|()| 0);
    }
    if held.is_empty() {
        return output("no locks held\n").map(|()| 0);
    }
    let header = [
        "KEY",
        "STRATEGY",
        "MODE",
        "OWNER",
        "TOKEN",
        "ACQUIRED (UTC)",
        "EXPIRES (UTC)",
        "AGE",
        "WAITING",
    ]
    .map(str::to_owned);
    let rows: Vec<[String; 9]> = held
        .iter()
        .map(|i| {
            [
                i.key.clone(),
                i.strategy.to_string(),
                mode(i),
                i.owner.clone(),
                i.token.to_string(),
                time(i.acquired_at),
                i.expires_at.map_or_else(|| "-".to_owned(), time),
                age(i.age()),
                waiting(i),
            ]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.chars().count());
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut text = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        text.push_str(cells.join("  ").trim_end());
        text.push('\n');
    }
    output(&text).map(|()| 0)
}

/// How many wait in the key's line, and for how long the longest has waited: `2 (1.5s)`,
/// or `-` for none.
fn waiting(i: &LockInfo) -> String {
    match i.longest_wait {
        Some(w) if i.waiting > 0 => format!("{} ({})", i.waiting, age(w)),
        _ => "-".to_owned(),
    }
}

/// `exclusive`, `read`, `write`, or `permit of N`.
fn mode(i: &LockInfo) -> String {
    match i.permits {
        Some(n) => format!("{} of {n}", i.mode),
        None => i.mode.to_string(),
    }
}

pub(crate) fn describe_holder(i: &LockInfo) -> String {
    let expires = match i.remaining() {
        Some(left) => format!(", expires in {}", age(left)),
        None => String::new(),
    };
    format!(
        "{:?} ({} {}, token {}, since {} UTC, {} ago{expires})",
        i.owner,
        i.strategy,
        mode(i),
        i.token,
        time(i.acquired_at),
        age(i.age())
    )
}

pub(crate) fn status(db: &Database, key: &str) -> Result<u8, Failure> {
    let held = held_locks(db, Some(key))?;
    if held.is_empty() {
        output(&format!("{key:?} is free\n"))?;
        return Ok(0);
    }
    let mut text = String::new();
    for i in &held {
        text.push_str(&format!("{key:?} is held by {}\n", describe_holder(i)));
    }
    output(&text)?;
    Ok(1)
}
