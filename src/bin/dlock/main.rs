//! `dlock`: run a command under a distributed lock kept in PostgreSQL, MySQL/MariaDB or
//! SQLite, and look at or clear the locks held.
//!
//! This file holds `main`: it reads the command line, dispatches to one module per command
//! and turns the outcome into dlock's exit code. The modules:
//!
//! - `args`: the clap definitions, option parsing, exit codes and `Failure`;
//! - `database`: the database URL, its secrets kept out of every message, connecting;
//! - `run`: `dlock run` from taking the lock to releasing it;
//! - `supervise`: what runs beside the command (the lock watcher, the wait for the command,
//!   `--min-hold`);
//! - `job`: the command's process (its process group, guardian, parent-death signal,
//!   descriptors, reaping);
//! - `list`: `dlock list` and `dlock status`;
//! - `release`: `dlock release`, `dlock migrate` and `dlock purge`.

mod args;
mod database;
mod job;
mod list;
mod release;
mod run;
mod supervise;

use args::{one_line_usage_error, Cli, Command, Failure, EXIT_RUNTIME, EXIT_USAGE};
use clap::Parser;
use database::Database;
use job::inherited_fds;
use list::{list, status};
use release::{migrate, purge, release};
use run::run;
use std::io::{self, Write};
use std::process::ExitCode;

fn main() -> ExitCode {
    let code = main_code();
    ExitCode::from(code)
}

fn main_code() -> u8 {
    // Before anything of dlock's is opened.
    let inherited_fds = inherited_fds();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    EXIT_USAGE
                } else {
                    0
                };
            }
            eprintln!("dlock: {}", one_line_usage_error(&e));
            return EXIT_USAGE;
        }
    };
    env_logger::Builder::from_env(
        env_logger::Env::default().default_filter_or(if cli.verbose { "debug" } else { "off" }),
    )
    .format_timestamp_millis()
    .init();
    let db = Database::new(cli.url.clone());
    // A panic (a bug) unwinds through `run`, which kills the command and releases the lock on
    // the way, and ends dlock here; the panic message has been printed already.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match cli.command {
        Command::Run(args) => run(&db, args, cli.verbose, inherited_fds),
        Command::List { json } => list(&db, json),
        Command::Status { key } => status(&db, &key),
        Command::Release { force, key } => release(&db, &key, force),
        Command::Migrate => migrate(&db),
        Command::Purge { older_than } => purge(&db, older_than),
    }))
    .unwrap_or_else(|_| {
        Err(Failure::new(
            EXIT_RUNTIME,
            "internal error (a bug, described above); the command was stopped and the lock released",
        ))
    });
    let code = match result {
        Ok(code) => code,
        Err(f) => {
            eprintln!("dlock: {}", db.scrub(&f.message));
            f.code
        }
    };
    let _ = io::stdout().flush();
    let _ = io::stderr().flush();
    // Leave without running the C library's exit handlers: r2d2 may still be opening a
    // connection in a background thread (to refill the pool), and with PostgreSQL over TLS
    // OpenSSL's exit handler frees the state that handshake is using: a segfault in about one
    // exit in ten. Nothing of ours is left to clean up at this point: every guard has been
    // released and all output flushed.
    signal_hook::low_level::exit(i32::from(code))
}
