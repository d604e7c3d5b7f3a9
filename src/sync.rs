//! Poisoned locks are taken as they are, written once: a thread that panicked while holding
//! one of the crate's mutexes or read-write locks leaves state that is still consistent
//! (every critical section either completes its update or makes none), and a lock library
//! that panicked in every other thread after one panic would turn a bug into an outage.

use std::sync::{LockResult, PoisonError};

/// `lock().unpoisoned()`: the guard, whether or not a panic poisoned the lock.
pub(crate) trait Unpoison<T> {
    /// The value inside, poisoned or not.
    fn unpoisoned(self) -> T;
}

impl<T> Unpoison<T> for LockResult<T> {
    fn unpoisoned(self) -> T {
        self.unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::Unpoison;
    use std::sync::{Arc, Mutex};

    #[test]
    fn a_poisoned_lock_is_taken_with_its_value() {
        let m = Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let mut g = m2.lock().unwrap();
            *g = 2;
            panic!("poison it");
        })
        .join();
        assert!(m.lock().is_err(), "poisoned");
        assert_eq!(*m.lock().unpoisoned(), 2);
    }
}
