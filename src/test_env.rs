//! The unit tests' one way to find a real server (tests only).

/// The URL in the environment variable `var`, or `None` where it is unset and the server
/// named `name` (`pg`, `mysql`) is not required: `DLOCK_TEST_REQUIRE` lists the required
/// servers (`all`, or names separated by commas or spaces), and a required one that has no
/// URL fails the test instead of skipping it.
pub(crate) fn server_url(var: &str, name: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(u) if !u.is_empty() => Some(u),
        _ => {
            let required = std::env::var("DLOCK_TEST_REQUIRE").unwrap_or_default();
            assert!(
                !required.split([',', ' ']).any(|r| r == "all" || r == name),
                "{var} is not set"
            );
            None
        }
    }
}
