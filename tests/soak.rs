//! The short soak (issue 12's "long runs", in small): 6 processes × 300 acquisitions of one
//! key, per backend × strategy, each holder incrementing a racy counter; the counter must
//! end at 1,800, tokens must be unique and increase in the order the holders came. The long
//! runs are `examples/soak.rs`; both share `common/soak.rs`.

mod common;
#[path = "common/soak.rs"]
mod soak;

use soak::Soak;
use std::process::Command;

const PROCESSES: usize = 6;
const ACQUISITIONS: usize = 300;

#[test]
#[ignore = "entry point for the soak's child processes"]
fn child_entry() {
    soak::child();
}

fn child_command() -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args([
        "--exact",
        "child_entry",
        "--ignored",
        "--nocapture",
        "--quiet",
    ]);
    c
}

fn soak(url: &str, strategy: &str) {
    let s = Soak {
        url: url.to_owned(),
        strategy: strategy.to_owned(),
        processes: PROCESSES,
        acquisitions: ACQUISITIONS,
    };
    let out = soak::run(&s, child_command).unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "{strategy} on {}: {} acquisitions in {:.2?} ({:.0}/s), longest streak {}",
        url.split(':').next().unwrap(),
        out.acquisitions,
        out.elapsed,
        out.rate,
        out.longest_streak
    );
}

/// The check itself: six processes that take no lock lose increments, and the soak says so.
#[cfg(feature = "sqlite")]
#[test]
fn the_check_catches_holders_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let s = Soak {
        url: format!("sqlite://{}", dir.path().join("soak.db").display()),
        strategy: "none".to_owned(),
        processes: PROCESSES,
        acquisitions: 50,
    };
    let err = soak::run(&s, child_command).expect_err("unlocked increments all survived");
    assert!(
        err.contains("lost") || err.contains("saw the counter"),
        "{err}"
    );
}

#[cfg(feature = "sqlite")]
mod sqlite {
    fn run(strategy: &str) {
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite://{}", dir.path().join("soak.db").display());
        super::soak(&url, strategy);
    }

    #[test]
    fn row() {
        run("row");
    }

    #[test]
    fn lease() {
        run("lease");
    }
}

/// The four strategies on a server whose URL is in `$var` (`$name` for DLOCK_TEST_REQUIRE).
macro_rules! server_soaks {
    ($module:ident, $feature:literal, $var:literal, $name:literal) => {
        #[cfg(feature = $feature)]
        mod $module {
            fn run(strategy: &str) {
                if let Some(url) = super::common::url($var, $name) {
                    super::soak(&url, strategy);
                }
            }

            #[test]
            fn row() {
                run("row");
            }

            #[test]
            fn lease() {
                run("lease");
            }

            #[test]
            fn for_update() {
                run("for-update");
            }

            #[test]
            fn advisory() {
                run("advisory");
            }
        }
    };
}

server_soaks!(postgres, "postgres", "DLOCK_TEST_PG_URL", "pg");
server_soaks!(mysql, "mysql", "DLOCK_TEST_MYSQL_URL", "mysql");
